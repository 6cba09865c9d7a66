"""Where the start of `mmgen generate --gpus N` goes before its ranks can load: the launcher's parse against
the started ranks' imports and their world's set-up (issue 37: a multi-GPU start no slower than one GPU).

    python3 benchmarks/rank_start.py --device cuda --gpus 2,4 [--runs 3]
    python3 benchmarks/rank_start.py --device cpu --gpus 2          # gloo ranks: a smoke run of the harness

Each run is a fresh interpreter doing what `mmgen generate --gpus N` does first (mmgen.cli.main): it
starts N rank processes (mmgen.parallel.standby.StartedRanks, the command's preload modules and early
world), then imports what the command's parse imports (torch and the request: the launcher's "parse"),
then hands every rank a function that reports its EarlySetup's times. Printed per run and rank, in
seconds from the launcher's first line: the parse done, the rank's imports done, its world joined (CUDA
context, the NCCL communicators and their warm-up), its work received. A rank that is ready after the
parse delays the load by the difference; one GPU's start is the parse alone (cold_start.py's table 2).
"""

from __future__ import annotations

import time

STARTED = time.time()  # noqa: E402 - before every import

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from checkout import checkout_pythonpath  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def report_times(began: float, results, early) -> None:
    """A started rank's assignment: its rank, EarlySetup stamps (imports done, join begun, device set,
    process group made, world joined), when its work came (all in seconds from `began`) and its error.
    The work may come before the world is joined (standby.PendingSetup joins it in a thread, from
    torch's import on, beside the rest of the imports)."""
    received = time.time() - began
    setup = early.result()
    results.put(
        {
            "rank": 0 if setup.layout is None else setup.layout.rank,
            **setup.times(since=began),
            "received": received,
            "error": None if setup.error is None else repr(setup.error),
        }
    )


def one_run(gpus: int, device: str) -> dict:
    """This interpreter as a `generate --gpus N` launcher (see the module docstring)."""
    from mmgen.cli import RANK_MODULES
    from mmgen.parallel.process import DEFAULT_TIMEOUT_S, free_port
    from mmgen.parallel.standby import EarlyWorld, StartedRanks

    world = EarlyWorld(
        gpus=gpus,
        sp=None,
        ring=1,
        cfg=False,
        address=f"tcp://127.0.0.1:{free_port()}",
        timeout_s=DEFAULT_TIMEOUT_S,
    )
    with StartedRanks(gpus, RANK_MODULES, device=device, world=world) as ranks:
        spawned = time.time() - STARTED
        import torch  # noqa: F401 - the parse's imports (mmgen.cli.run_generate's checks)

        import pipelines.loader  # noqa: F401
        import pipelines.request  # noqa: F401
        from mmgen.families import makes_images  # noqa: F401

        parsed = time.time() - STARTED
        for position in range(gpus):
            ranks.assign(position, report_times, (STARTED,))
        found = sorted(
            (ranks.results.get(timeout=DEFAULT_TIMEOUT_S) for _ in range(gpus)), key=lambda r: r["rank"]
        )
    errors = [row["error"] for row in found if row["error"]]
    if errors:
        raise SystemExit(f"a rank failed to join its world: {errors[0]}")
    return {"spawned": spawned, "parsed": parsed, "ranks": found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--gpus", default="2", help="comma-separated rank counts, e.g. 2,4")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # internal: one run of N ranks
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(one_run(args.child, args.device)))
        return
    env = {**os.environ, "PYTHONPATH": checkout_pythonpath()}
    print(
        f"{'gpus':<5} {'run':<4} {'parse':>7} {'rank':>5} {'torch':>7} {'imports':>8} {'device':>7} {'process':>8}"
        f" {'groups':>7} {'ready':>7} {'late':>6}"
    )
    found = {}
    for gpus in (int(n) for n in args.gpus.split(",")):
        runs = []
        for run in range(args.runs):
            command = [sys.executable, __file__, "--device", args.device, "--child", str(gpus)]
            done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
            if done.returncode != 0:
                raise SystemExit(f"rank_start child failed:\n{done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            runs.append(row)
            for rank, times in enumerate(row["ranks"]):
                late = max(0.0, times["joined"] - row["parsed"])  # what the load waits for
                print(
                    f"{gpus:<5} {run + 1:<4} {row['parsed']:7.2f} {rank:>5} {times['began']:7.2f}"
                    f" {times['imported']:8.2f} {times['device'] - times['began']:7.2f}"
                    f" {times['process'] - times['device']:8.2f}"
                    f" {times['joined'] - times['process']:7.2f} {times['joined']:7.2f} {late:6.2f}"
                )
        lates = [max(r["joined"] for r in row["ranks"]) - row["parsed"] for row in runs]
        print(
            f"{gpus} ranks: the slowest rank ready {statistics.median(lates):+.2f} s after the parse (median)"
        )
        found[str(gpus)] = runs
    print("parse: the launcher's imports done; torch: a rank's torch imported (its join begins); imports:")
    print("its preload imports done (beside the join); device: its device set (the CUDA context); process:")
    print(
        "init_process (rendezvous, the world's communicator); groups: init_layout (groups, warm-up); ready:"
    )
    print("world joined; late: ready - parse")
    print("(seconds from the launcher's start). The world joins beside the load (standby.PendingSetup): a")
    print("load of that long or longer hides it")
    if args.json:
        args.json.write_text(json.dumps(found, indent=2) + "\n")


if __name__ == "__main__":
    main()
