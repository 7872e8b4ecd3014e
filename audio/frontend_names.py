"""The token front ends by name. Torch-free, so that a command line lists them without loading torch."""
FRONTENDS = ("musicnn", "vggish")
