"""The small model shape the tests share (d = 32, 4 heads): as a config, or as a seeded model."""
from models.transformer import ModelConfig, build_model

TINY = dict(d_model=32, heads=4, ff_dim=64)


def tiny_config(**kw) -> ModelConfig:
    """window 12, m = 3, 16-d tokens unless overridden."""
    return ModelConfig(**{**dict(window=12, num_landmarks=3, in_dim=16), **TINY, **kw})


def tiny_model(variant: str, *, n: int, in_dim: int = 128, landmarks: int = 2, seed: int = 0, **kw):
    """A seeded tiny model in eval mode (the same weights for the same arguments)."""
    cfg = tiny_config(variant=variant, window=n, in_dim=in_dim, num_landmarks=landmarks, **kw)
    return build_model(cfg, seed=seed).eval()
