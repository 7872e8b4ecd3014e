"""`bench --onnx`: the exported step (ONNX Runtime, CPU provider, one thread) against the torch
step and the fused step of the same model, batch 1, window full, with the FLOPs of a step and the
exported file's size: the shipped musicnn models (n = 29) and untrained models of the papers'
size (d = 192, 16 heads, n = 120, m = 4), with 1 and 2 blocks."""
from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch

from app.runtime.onnx_step import OnnxStep
from app.checkpoint import load_checkpoint
from audio.assets import assets_dir
from models.landmarks import fit_fixed_landmarks
from app.offline.onnx_export import export_onnx
from models.transformer import ModelConfig, build_model

from .timing import time_steps

ASSETS = assets_dir() / "models"
SHIPPED = ("musicnn-continual", "musicnn-continual_nystrom", "musicnn-continual_nystrom-fixed")


def paper_model(variant: str, fixed: bool, layers: int = 1) -> torch.nn.Module:
    cfg = ModelConfig(variant=variant, in_dim=50, window=120, num_landmarks=4, layers=layers)
    model = build_model(cfg, seed=0, fused=False).eval()
    if fixed:
        fit_fixed_landmarks(model, torch.randn(4, 120, 50, generator=torch.Generator().manual_seed(0)))
    return model


def models() -> list[tuple[str, object]]:
    """(label, build) of every model timed; build() -> (torch model, classes, front end)."""
    def shipped(name):
        def build():
            model, payload = load_checkpoint(ASSETS / f"{name}.pt", fused=False)
            return model, payload["classes"], payload["frontend"]
        return build

    def paper(variant, fixed, layers):
        return lambda: (paper_model(variant, fixed, layers), [str(i) for i in range(10)],
                        {"name": "musicnn", "token_dim": 50, "spacing_hops": 1})
    out = [(f"{name} (trained, n = 29)", shipped(name)) for name in SHIPPED]
    for layers in (1, 2):
        for variant, fixed in (("continual", False), ("continual_nystrom", False), ("continual_nystrom", True)):
            label = variant + ("/fixed" if fixed else "/continual" if variant != "continual" else "")
            blocks = ", 2 blocks" if layers == 2 else ""
            out.append((f"{label} (d = 192, n = 120{blocks})", paper(variant, fixed, layers)))
    return out


def onnx_bench(steps: int = 2000, budget_s: float = 6.0, only: str = "") -> dict:
    """The rows of every model whose label contains ``only``."""
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for label, build in models():
            if only not in label:
                continue
            model, classes, fe = build()
            path = Path(folder) / "m.onnx"
            export_onnx(model, path, classes=classes, frontend=fe)
            paths = {"torch": model, "fused": copy.deepcopy(model).use_fused(True), "onnx": OnnxStep(path)}
            g = torch.Generator().manual_seed(1)
            tokens = torch.rand(4096, 1, model.cfg.in_dim, generator=g)
            row = {"model": label, "bytes": path.stat().st_size, "window": model.cfg.window,
                   "blocks": model.cfg.layers, "nodes": graph_nodes(path)}
            for name, m in paths.items():
                m.reset(1)
                index = iter(range(10 ** 9))
                for _ in range(2 * model.cfg.window):                 # past warm-up: full windows
                    m.step(tokens[next(index) % len(tokens)])
                median, p95 = time_steps(lambda: m.step(tokens[next(index) % len(tokens)]), steps, budget_s)
                row[name] = {"median_us": median, "p95_us": p95, "flops": m.step_flops()}
            rows.append(row)
    return {"rows": rows, "threads": 1, "steps": steps}


def graph_nodes(path: Path) -> int:
    """Nodes of the exported graph's top level (ONNX Runtime dispatches each every step; the
    nodes inside an If run only when it takes that branch)."""
    import onnx
    return len(onnx.load(str(path)).graph.node)


def onnx_table(r: dict) -> list[str]:
    lines = ["| model | model FLOPs / step | torch step median / p95 (us) | fused step | ONNX Runtime | "
             "ONNX Runtime vs torch / fused | file |",
             "| --- | ---: | --- | --- | --- | --- | ---: |"]
    for row in r["rows"]:
        t, f, o = row["torch"], row["fused"], row["onnx"]
        cell = lambda x: f"{x['median_us']:.0f} / {x['p95_us']:.0f}"  # noqa: E731
        lines.append(f"| {row['model']} | {t['flops']['model'] / 1e3:.0f}k | {cell(t)} | {cell(f)} | {cell(o)} | "
                     f"{t['median_us'] / o['median_us']:.2f}x / {f['median_us'] / o['median_us']:.2f}x | "
                     f"{row['bytes'] / 1e6:.1f} MB |")
    return lines


def print_onnx(r: dict) -> None:
    print("exported step (ONNX Runtime, CPU, 1 thread) vs torch and fused steps, batch 1, window full:")
    for line in onnx_table(r):
        print(line)
