"""The published numbers we compare against, in one place (evaluation, reports, bench, tests).

Carreto Picón et al., "Continual Low-Rank Scaled Dot-product Attention", Table II: GTZAN, VGGish
tokens, n = 120, m = 4, d = 192, random 72/18/10 splits.
"""
TABLE_ROWS = ("regular", "continual", "nystrom", "continual_nystrom/continual",
              "continual_nystrom/fixed")

PAPER_TABLE_II = {   # SDA FLOPs per step, one head of d = 192
    "regular": 11.1e6, "continual": 0.09e6, "nystrom": 0.42e6,
    "continual_nystrom/continual": 0.01e6, "continual_nystrom/fixed": 0.006e6,
}

PAPER_ACCURACY = {   # test accuracy, %
    "regular": 93.1, "continual": 93.2, "nystrom": 93.5,
    "continual_nystrom/continual": 92.9, "continual_nystrom/fixed": 90.8,
}
