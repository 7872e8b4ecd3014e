"""What a server process needs to build its hub: plain values, picklable (for a process other
than the one that parsed the command line)."""
from __future__ import annotations

from dataclasses import dataclass, field

from app.runtime.frontend_args import FrontEndSpec

from .protocol import Limits

# A lane's ready hop waits at most this for its other streams' hops (app/serve/hub.py). 40 ms
# against 10 ms, 24 clients of `bench --serve` on 2 cores (AMD EPYC, speed index 1.7-2.6 ms), five
# turns each, 2026-11-27: the server's cores 1.35-1.57 (median 1.49) against 1.62-1.63, a lane's
# hop took 2.5-2.8 streams against 2.0-2.4, latency p95 105-182 ms (median 126) against 121-158
# (median 132). A stream costs a lane's hop of 1 stream 17 ms, of 16 streams 10.5 ms.
BATCH_DELAY_MS = 40.0


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
