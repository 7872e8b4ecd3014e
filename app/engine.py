"""The streaming engine: source -> log-mel -> VGGish token (once per hop) -> every model's step.

A plain Python object (no Qt): the CLI, the GUI and the tests drive it the same way. Each hop gives
one ``StepResult`` with the probabilities, FLOPs, latency and state memory of every model.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from audio.gtzan import GENRES
from audio.tokens import TokenStream
from audio.vggish import Embedder


@dataclass
class StepResult:
    step: int                                   # hop / token index
    audio_time: float                           # seconds of audio up to the end of this hop
    source: str
    vggish: str                                 # which VGGish weights made the token
    probabilities: dict[str, list[float]]       # model -> 10 genre probabilities
    top: dict[str, tuple[str, float]]           # model -> (genre, probability)
    flops: dict[str, dict[str, int]]            # model -> {'sda', 'attention', 'model'}
    latency_ms: dict[str, float]                # 'frontend', 'vggish', and one per model
    state_bytes: dict[str, int]                 # model -> streaming state size
    untrained: dict[str, bool]                  # model -> no trained checkpoint loaded
    dropped_hops: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class Engine:
    """Runs every model on the tokens of one source. ``models``: name -> GenreTransformer."""

    def __init__(self, embedder: Embedder, models: dict, trained: dict[str, bool] | None = None):
        self.embedder, self.models = embedder, dict(models)
        self.trained = {name: (trained or {}).get(name, False) for name in self.models}

    def run(self, source):
        """Yield one StepResult per hop of ``source`` until it ends."""
        for model in self.models.values():
            model.eval()
            model.reset(1)
        for item in TokenStream(source, self.embedder):
            probabilities, top, flops, latency, memory = {}, {}, {}, {}, {}
            latency["frontend"], latency["vggish"] = item.frontend_ms, item.vggish_ms
            for name, model in self.models.items():
                t0 = time.perf_counter()
                logits = model.step(item.token.to(model.embed.weight.device))
                p = torch.softmax(logits[0].float(), dim=-1).cpu()
                latency[name] = (time.perf_counter() - t0) * 1e3
                probabilities[name] = [round(float(x), 6) for x in p]
                best = int(p.argmax())
                top[name] = (GENRES[best], float(p[best]))
                flops[name] = model.step_flops()
                memory[name] = model.state_nbytes()
            yield StepResult(item.index, item.audio_time, source.name, self.embedder.description,
                             probabilities, top, flops, latency, memory,
                             {n: not self.trained[n] for n in self.models},
                             dropped_hops=source.stats.dropped)
