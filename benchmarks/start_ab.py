"""One question: does a change make `mmgen generate` start sooner? Two checkouts' commands, runs alternating.

    git archive BASE mmgen pipelines | tar -x -C /tmp/before     # the tree before the change
    python3 benchmarks/start_ab.py --model DIR --device cuda --gpus 1,4 --runs 3 --size 480 832 21 \\
        --trees /tmp/before .

Each tree is a directory holding `mmgen/` and `pipelines/` (a checkout, or `git archive` of one); its
command runs from there with it first on PYTHONPATH (benchmarks/cold_start.py's `cli_wall`: a fresh
process, wall seconds from the shell, its `seconds:` line and its frames' sha256). One untimed run per
(tree, GPU count) first, then every (tree, count) once per round, so a drift of the host hits each alike.
Prints each run, then per (count, tree) the medians of the wall and of each part, and the frames' sha256
(one per model over every tree and count when the change keeps the output).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from cold_start import cli_wall

PARTS = ("start", "load", "world_wait", "text_encode", "denoise", "decode", "export", "ended")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, help="model directory (cold_start.py --write; default: the embedded one)"
    )
    parser.add_argument("--trees", type=Path, nargs="+", required=True, help="checkouts to compare (A first)")
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--gpus", default="1", help="comma list of GPU counts")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, help="default: the model's; 1 with --model (as cold_start.py)")
    parser.add_argument("--size", nargs=3, type=int, metavar=("H", "W", "F"))
    args = parser.parse_args()
    trees = [tree.resolve() for tree in args.trees]
    counts = [int(n) for n in args.gpus.split(",")]
    cases = [(gpus, tree) for gpus in counts for tree in trees]
    for gpus, tree in cases:  # untimed
        cli_wall(args, gpus if gpus > 1 else None, root=tree)
    measured: dict = {case: [] for case in cases}
    print(
        f"{'round':<6} {'gpus':<5} {'tree':<24} {'wall':>6}  "
        + " ".join(f"{p:>11}" for p in PARTS)
        + "  sha256"
    )
    for index in range(args.runs):
        for gpus, tree in cases:
            try:
                wall, split, sha = cli_wall(args, gpus if gpus > 1 else None, root=tree)
            except SystemExit as failed:  # a failed command: said, counted, and the rounds go on
                print(
                    f"{index + 1:<6} {gpus:<5} {str(tree)[-24:]:<24} FAILED: {str(failed)[-300:]}", flush=True
                )
                continue
            measured[(gpus, tree)].append((wall, split, sha))
            cells = " ".join(f"{split.get(p, 0.0):11.2f}" for p in PARTS)
            print(
                f"{index + 1:<6} {gpus:<5} {str(tree)[-24:]:<24} {wall:6.2f}  {cells}  {sha[:12]}", flush=True
            )
    print(f"\nmedians of {args.runs} runs")
    print(f"{'gpus':<5} {'tree':<24} {'wall':>6}  " + " ".join(f"{p:>11}" for p in PARTS))
    for (gpus, tree), runs in measured.items():
        if not runs:
            print(f"{gpus:<5} {str(tree)[-24:]:<24} (every run failed)")
            continue
        wall = statistics.median(w for w, _, _ in runs)
        cells = " ".join(f"{statistics.median(s.get(p, 0.0) for _, s, _ in runs):11.2f}" for p in PARTS)
        print(f"{gpus:<5} {str(tree)[-24:]:<24} {wall:6.2f}  {cells}")
    shas = {sha for runs in measured.values() for _, _, sha in runs}
    print(
        f"\nframes sha256: {'one over every tree and count' if len(shas) == 1 else 'DIFFER'}: {sorted(shas)}"
    )


if __name__ == "__main__":
    main()
