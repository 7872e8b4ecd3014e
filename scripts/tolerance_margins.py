"""Print each tolerance's worst observed error and its margin, from a `pytest --margins FILE` run.

    python scripts/tolerance_margins.py FILE [--min 3]

Exits 1 if any tolerance's margin (tolerance / worst observed) is below --min.
"""
import argparse
import json
from collections import defaultdict


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("file")
    p.add_argument("--min", type=float, default=3.0, help="smallest margin accepted")
    args = p.parse_args()
    worst = defaultdict(lambda: [0.0, float("inf"), 0, 0.0])   # observed, smallest ratio, checks, tol
    with open(args.file) as f:
        for line in f:
            r = json.loads(line)
            w = worst[r["name"]]
            ratio = r["tolerance"] / r["observed"] if r["observed"] > 0 else float("inf")
            if ratio < w[1]:
                w[1], w[3] = ratio, r["tolerance"]
            w[0] = max(w[0], r["observed"])
            w[2] += 1
    print(f"{'tolerance':58s} {'checks':>7s} {'worst':>10s} {'tol there':>10s} {'margin':>8s}")
    low = []
    for name, (obs, ratio, n, tol) in sorted(worst.items()):
        print(f"{name:58s} {n:7d} {obs:10.3g} {tol:10.3g} {ratio:8.1f}")
        if ratio < args.min:
            low.append(name)
    if low:
        print(f"margin below {args.min}: {', '.join(low)}")
    return 1 if low else 0


if __name__ == "__main__":
    raise SystemExit(main())
