"""The attention variants by name, and the landmark modes each accepts (None: no landmarks).
Torch-free, so that a command line lists them without loading torch."""
VARIANTS = ("regular", "continual", "nystrom", "continual_nystrom")
LANDMARK_MODES = {"regular": (None,), "continual": (None,),
                  "nystrom": ("segment", "fixed"), "continual_nystrom": ("continual", "fixed")}
