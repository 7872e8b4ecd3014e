"""`python main.py export`: a checkpoint's streaming step as an ONNX graph with explicit state
(app/offline/onnx_export.py), run once by ONNX Runtime against the torch step before it is reported."""
from __future__ import annotations

import json
from pathlib import Path

from . import command, error
from .argtypes import POSITIVE, writable_file


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True, metavar="CKPT", help="a trained checkpoint (.pt)")
    p.add_argument("--onnx", required=True, metavar="OUT.onnx", type=writable_file,
                   help="the ONNX file to write")
    p.add_argument("--check-steps", type=POSITIVE, default=300, metavar="N",
                   help="steps of seeded random tokens run by ONNX Runtime and by the torch step, "
                        "to report their largest logit difference")


@command("export", add_arguments)
def run(args) -> int:
    import torch

    from app.runtime.onnx_step import OnnxModelError, OnnxStep
    from app.offline.onnx_export import NotExportable, export_onnx
    from app.checkpoint import CheckpointError, load_checkpoint
    try:
        model, payload = load_checkpoint(args.checkpoint, fused=False)
        export_onnx(model, args.onnx, classes=payload["classes"], frontend=payload["frontend"],
                    metadata={"checkpoint": Path(args.checkpoint).name})
        exported = OnnxStep(args.onnx)
        g = torch.Generator().manual_seed(0)
        model.reset(1)
        exported.reset(1)
        worst = 0.0
        for _ in range(args.check_steps):
            token = torch.randn(1, model.cfg.in_dim, generator=g)
            worst = max(worst, float((model.step(token) - exported.step(token)).abs().max()))
    except (CheckpointError, NotExportable, OnnxModelError) as e:
        return error(e)
    print(json.dumps({"onnx": str(args.onnx), "bytes": Path(args.onnx).stat().st_size,
                      "kind": exported.kind, "blocks": exported.cfg.layers, "classes": len(exported.classes),
                      "state": {n: list(s) for n, s, _ in exported.specs},
                      "check_steps": args.check_steps, "max_logit_difference": worst}))
    return 0
