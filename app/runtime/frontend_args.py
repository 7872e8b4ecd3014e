"""The front-end argument group, defined once for every command that computes tokens, and the
front end it selects."""
from __future__ import annotations

import sys
from dataclasses import dataclass

from audio.frontend_names import FRONTENDS


def add_frontend_arguments(p, *, fallback: bool = False, recompute: bool = False) -> None:
    """--frontend, --vggish-weights | --random-vggish, --vggish-seed (and, if asked,
    --fallback-random-vggish, --recompute-frontend)."""
    g = p.add_argument_group("front end (audio -> tokens)")
    g.add_argument("--frontend", choices=FRONTENDS, default=None,
                   help="musicnn (default; its pretrained weights ship) or vggish (the paper's; "
                        "implied by --vggish-weights / --random-vggish)")
    w = g.add_mutually_exclusive_group()
    w.add_argument("--vggish-weights", metavar="FILE",
                   help="VGGish state dict (default: $NYSTREAM_VGGISH_WEIGHTS, the torch hub cache, "
                        "else a download)")
    w.add_argument("--random-vggish", action="store_true",
                   help="RANDOM VGGish weights (seeded by --vggish-seed): the real architecture, "
                        "meaningless tokens; for tests and demos")
    g.add_argument("--vggish-seed", type=int, default=0, metavar="SEED",
                   help="seed of --random-vggish (default 0)")
    if fallback:
        g.add_argument("--fallback-random-vggish", action="store_true",
                       help="if no VGGish weights are found, say so and use random ones")
    if recompute:
        g.add_argument("--recompute-frontend", action="store_true",
                       help="recompute musicnn's whole 3 s patch every hop (the reference) instead "
                            "of the continual front end")


def random_seed(args) -> int | None:
    """The VGGish seed when random weights were asked for, else None."""
    return args.vggish_seed if args.random_vggish else None


def frontend_name(args) -> str:
    from audio.frontends import resolve_name
    return resolve_name(args.frontend, args.vggish_weights, random_seed(args))


def frontend_or_random(name: str, *, device="cpu", vggish_weights=None, random_vggish=None,
                       continual: bool = True, on_missing=None, allow_download: bool = True, precision: str = "float32"):
    """``build_frontend``; if VGGish weights are missing and ``on_missing`` is given, it hears
    the VGGishWeightsError and a RANDOM VGGish (seed ``random_vggish`` or 0) is used instead."""
    from audio.errors import VGGishWeightsError
    from audio.frontends import build_frontend
    try:
        return build_frontend(name, device=device, vggish_weights=vggish_weights,
                              random_vggish=random_vggish, continual=continual,
                              allow_download=allow_download, precision=precision)
    except VGGishWeightsError as e:
        if on_missing is None:
            raise
        on_missing(e)
        return build_frontend("vggish", device=device, random_vggish=random_vggish or 0)


def frontend_from_args(args, device="cpu"):
    """The front end the arguments select; with --fallback-random-vggish a missing VGGish
    becomes a random one (said on stderr)."""
    def say(e):
        print(f"# {e}\n# continuing with RANDOM VGGish weights", file=sys.stderr)
    return frontend_or_random(frontend_name(args), device=device, vggish_weights=args.vggish_weights,
                              random_vggish=random_seed(args),
                              continual=not getattr(args, "recompute_frontend", False),
                              on_missing=say if getattr(args, "fallback_random_vggish", False) else None,
                              precision=getattr(args, "precision", "float32"))


@dataclass(frozen=True)
class FrontEndSpec:
    """What another process (a Ray worker, the engine process) needs to build a front end."""
    name: str
    vggish_weights: str | None = None
    random_vggish: int | None = None
    continual: bool = True
    device: str = "cpu"
    allow_download: bool = False
    precision: str = "float32"        # musicnn's arithmetic (audio/musicnn: ``PRECISIONS``)

    def build(self, on_missing=None):
        """The front end (``on_missing``: see frontend_or_random)."""
        return frontend_or_random(self.name, device=self.device, vggish_weights=self.vggish_weights,
                                  random_vggish=self.random_vggish, continual=self.continual,
                                  on_missing=on_missing, allow_download=self.allow_download, precision=self.precision)


def device_text(device: str, precision: str = "float32") -> str:
    """What runs where, for a run's header: 'device cpu, float32' or the GPU's name, and
    musicnn's precision where it is not float32."""
    from audio.musicnn import PRECISION_WORDS
    where = "device cpu"
    if device == "cuda":
        import torch
        where = f"device cuda ({torch.cuda.get_device_name()})"
    return f"{where}, float32" + ("" if precision == "float32" else f", musicnn in {PRECISION_WORDS[precision]}")
