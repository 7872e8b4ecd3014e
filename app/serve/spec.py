"""What a server process needs to build its hub: plain values, picklable (for a process other
than the one that parsed the command line)."""
from __future__ import annotations

from dataclasses import dataclass, field

from app.runtime.frontend_args import FrontEndSpec

from .protocol import BATCH_DELAY_MS, Limits


@dataclass(frozen=True)
class HubSpec:
    frontend: FrontEndSpec
    capacity: int = 32
    checkpoints: tuple[str, ...] = ()
    variants: tuple[str, ...] | None = None
    shape: dict = field(default_factory=dict)        # layers, window, landmarks, seed of untrained models
    limits: Limits = Limits()
    batch_delay_ms: float = BATCH_DELAY_MS

    def build(self):
        """The hub: front end, models (app/runtime/lineup.py) and engine."""
        import torch

        from app.runtime.lineup import default_lineup

        from .hub import Hub
        frontend = self.frontend.build()
        device = self.frontend.device if self.frontend.device == "cpu" or torch.cuda.is_available() else "cpu"
        entries = default_lineup(frontend, device, checkpoints=self.checkpoints,
                                 variants=list(self.variants) if self.variants is not None else None, **self.shape)
        return Hub(frontend, entries, self.capacity, self.limits, device=device,
                   batch_delay=self.batch_delay_ms / 1e3)
