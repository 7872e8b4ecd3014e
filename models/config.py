"""ModelConfig: a model's identity (shape, attention variant, landmark mode), every field type- and
range-checked, with size limits that hold for configs read from files (checkpoints)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass

from .variants import LANDMARK_MODES, VARIANTS

MAX_WINDOW = 8192              # tokens (34 min of 0.25 s hops): larger is refused, not allocated
MAX_PARAMETERS = 50_000_000    # 200 MB of float32 weights
FIELD_TYPES = {"variant": (str,), "in_dim": (int,), "d_model": (int,), "heads": (int,),
               "ff_dim": (int,), "dropout": (float, int), "window": (int,), "num_landmarks": (int,),
               "landmark_mode": (str, type(None)), "layers": (int,), "num_classes": (int,),
               "pos_encoding": (str,), "pos_period": (int, type(None)), "pinv_iters": (int,)}


@dataclass(frozen=True)
class ModelConfig:
    """A model's identity: its shape, its attention variant and the landmark mode it starts in.
    Frozen: derive another with ``cfg.replace(...)``. The mode a running model uses is model
    state (``GenreTransformer.landmark_mode``), switchable live."""
    variant: str = "continual_nystrom"
    in_dim: int = 128
    d_model: int = 192
    heads: int = 16
    ff_dim: int = 384
    dropout: float = 0.1
    window: int = 120          # n
    num_landmarks: int = 4     # m (Nyström variants)
    landmark_mode: str | None = None   # None: the variant's default ('segment' / 'continual');
                                       #   'fixed': k-means landmarks, fitted in a second phase
    layers: int = 1
    num_classes: int = 10
    pos_encoding: str = "learned"      # 'learned' or 'sinusoidal'
    pos_period: int | None = None      # T; None -> n. The papers use n or 2n - 1.
    pinv_iters: int = 6

    def __post_init__(self):
        for name, kinds in FIELD_TYPES.items():
            value = getattr(self, name)
            if not isinstance(value, kinds) or isinstance(value, bool):
                raise ValueError(f"{name} must be {' or '.join(k.__name__ for k in kinds)}, "
                                 f"got {type(value).__name__} {value!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; valid: {', '.join(VARIANTS)}")
        modes = LANDMARK_MODES[self.variant]
        if self.landmark_mode is not None and self.landmark_mode not in modes:
            raise ValueError(f"unknown landmark_mode {self.landmark_mode!r} for {self.variant!r}; "
                             f"valid: {modes}")
        if self.layers not in (1, 2):
            raise ValueError(f"layers must be 1 or 2, got {self.layers}")
        for name in ("in_dim", "d_model", "heads", "ff_dim", "num_classes", "pinv_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of heads ({self.heads})")
        if not (math.isfinite(self.dropout) and 0 <= self.dropout < 1):
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not 1 <= self.window <= MAX_WINDOW:
            raise ValueError(f"window must be in 1..{MAX_WINDOW} tokens, got {self.window}")
        if self.pos_encoding not in ("learned", "sinusoidal"):
            raise ValueError(f"pos_encoding must be 'learned' or 'sinusoidal', got {self.pos_encoding!r}")
        if not self.window <= self.period <= 2 * MAX_WINDOW:
            raise ValueError(f"pos_period must be in window ({self.window})..{2 * MAX_WINDOW}, "
                             f"got {self.pos_period}")
        if self.nystrom and not 1 <= self.num_landmarks <= self.window:
            raise ValueError(f"num_landmarks must satisfy 1 <= m <= window ({self.window}), "
                             f"got {self.num_landmarks}")
        if not 1 <= self.pinv_iters <= 100:
            raise ValueError(f"pinv_iters must be in 1..100, got {self.pinv_iters}")
        if self.parameter_count() > MAX_PARAMETERS:
            raise ValueError(f"a model of {self.parameter_count():,} parameters is over the limit of "
                             f"{MAX_PARAMETERS:,} (d_model {self.d_model}, ff_dim {self.ff_dim}, "
                             f"in_dim {self.in_dim}, num_classes {self.num_classes})")

    def parameter_count(self) -> int:
        """Weights of the model this config builds (the learned positions included)."""
        d, f = self.d_model, self.ff_dim
        block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d        # attention, feed-forward, 2 norms
        pos = self.period * d if self.pos_encoding == "learned" else 0
        return self.in_dim * d + d + pos + self.layers * block + d * self.num_classes + self.num_classes

    @property
    def nystrom(self) -> bool:
        return self.variant in ("nystrom", "continual_nystrom")

    @property
    def home_landmark_mode(self) -> str | None:
        """The landmark mode the model starts in: 'segment' / 'continual' / 'fixed', None
        without landmarks."""
        return (self.landmark_mode or LANDMARK_MODES[self.variant][0]) if self.nystrom else None

    @property
    def table_row(self) -> str:
        """The paper's Table II row: the variant, with continual Nyström's landmark mode."""
        if self.variant == "continual_nystrom" or self.landmark_mode == "fixed":
            return f"{self.variant}/{self.home_landmark_mode}"
        return self.variant

    @property
    def key(self) -> str:
        """Short display name: 'continual_nystrom/fixed 2-block' (the window, classify, bench)."""
        fixed = "/fixed" if self.landmark_mode == "fixed" else ""
        return f"{self.variant}{fixed}{' 2-block' if self.layers == 2 else ''}"

    @property
    def description(self) -> str:
        """Long name: Table II row, blocks, window and landmarks (reports, evaluate)."""
        m = f", m={self.num_landmarks}" if self.nystrom else ""
        return f"{self.table_row} ({self.layers} block{'s' if self.layers > 1 else ''}, n={self.window}{m})"

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def period(self) -> int:
        return self.pos_period or self.window

    def to_dict(self) -> dict:
        return asdict(self)
