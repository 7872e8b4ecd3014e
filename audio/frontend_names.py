"""The token front ends by name. Torch-free, so that a command line lists them without loading torch."""
FRONTENDS = ("musicnn", "vggish")
PRECISIONS = ("float32", "tf32", "bf16")     # musicnn's arithmetic (audio/musicnn: ``precision``)
