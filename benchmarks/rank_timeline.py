"""One question: in `mmgen generate --gpus 2`, when does each rank reach each point of its load, and who waits?

    python3 benchmarks/rank_timeline.py --model DIR --device cuda --runs 3 --size 480 832 21

Runs the real command (fresh processes, one untimed run first) through this file, which wraps functions
with time stamps (their first call) in the command's process and in its started ranks (they import this file
as their main module): the command's ranks started (mmgen.cli.early_ranks) and its run led once parsed
(lead.run_led), the world's join (init_process begun and done: the rendezvous and NCCL's communicator;
init_layout done: the groups and their warm-up), the pipeline's load (in_process.load_pipeline), the wait
for the world (launch.settled), the weights' exchange (share.share_reads: the ranks meet in its first
collective), the text shared (share.from_first_rank: rank 0 encodes, the others wait), the denoise loop and
its first Ulysses exchange (attention.qkv_to_heads, host time). Prints, per run and rank, seconds from the
command's start, then the command's seconds line; `--profile NAME` also profiles a stamped function's first
call in every process (the last run's). `--ab MODULE:FUNCTION` instead alternates runs with the function and
with it a no-op in every process (an A/B of one part of the start on one host; e.g.
mmgen.layers.kernel_set_up:library_set_up). Benchmark-only wrapping (the command is unchanged).
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time

STAMPS = "MMGEN_RANK_TIMELINE"  # set for the wrapped command: its processes print stamps to stderr
PROFILED = (
    "MMGEN_RANK_TIMELINE_PROFILE"  # a wrapped function whose first call each process profiles (--profile)
)
SKIPPED = "MMGEN_RANK_TIMELINE_SKIP"  # "module:function" made a no-op in every process (--ab's other arm)


def _stamp(rank: int, name: str) -> None:
    sys.stderr.write(f"@stamp {rank} {name} {time.time():.6f}\n")  # one write: ranks share the stream
    sys.stderr.flush()


def _wrap(module, attribute: str, rank_of) -> None:
    """Replace module.attribute by a function stamping '<attribute>+' and '<attribute>-' around its first
    call (a function called per layer stamps once)."""
    inner = getattr(module, attribute)
    calls = []

    def stamped(*args, **kwargs):
        if calls:
            return inner(*args, **kwargs)
        calls.append(1)
        rank = rank_of(*args, **kwargs)
        _stamp(rank, attribute + "+")
        try:
            if os.environ.get(PROFILED) == attribute:
                return _profiled(rank, inner, args, kwargs)
            return inner(*args, **kwargs)
        finally:
            _stamp(rank, attribute + "-")

    setattr(module, attribute, stamped)


def _profiled(rank: int, inner, args, kwargs):
    """inner(*args, **kwargs) under cProfile; its 20 functions of most own time printed as '@profile' lines."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    try:
        return profile.runcall(inner, *args, **kwargs)
    finally:
        stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
        top = sorted(stats.items(), key=lambda item: -item[1][2])[:20]
        for (file, line, name), (_, calls, own, total, _) in top:
            where = f"{os.path.basename(file)}:{line}({name})"
            sys.stderr.write(f"@profile {rank} {own:8.3f} {total:8.3f} {calls:6d}  {where}\n")
        sys.stderr.flush()


class _WrapOnImport:
    """A meta-path finder that wraps TARGETS' functions as their modules are first imported, so that
    wrapping imports nothing early (the command's own order of imports and rank starts is kept)."""

    def find_spec(self, name: str, path=None, target=None):
        skipped_module, _, skipped = os.environ.get(SKIPPED, "").partition(":")
        if name not in TARGETS and name != skipped_module:
            return None
        spec = next(
            (
                found
                for finder in sys.meta_path
                if finder is not self and hasattr(finder, "find_spec")
                for found in [finder.find_spec(name, path, target)]
                if found is not None
            ),
            None,
        )
        if spec is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            for attribute, rank_of in TARGETS.get(name, ()):
                _wrap(module, attribute, rank_of)
            if name == skipped_module:
                setattr(module, skipped, lambda *args, **kwargs: None)

        spec.loader.exec_module = exec_module
        return spec


def _rank_now(*_, **__) -> int:
    import torch.distributed as dist

    return dist.get_rank()


TARGETS = {
    "mmgen.parallel.launch": [
        ("settled", lambda layout: layout.rank),
        ("init_process", lambda rank, *_, **__: rank),  # the rendezvous and the world's NCCL communicator
    ],
    "mmgen.parallel.layout": [("init_layout", _rank_now)],  # the groups and their warm-up
    "mmgen.executors.in_process": [
        ("load_pipeline", lambda spec, parallel=None, **_: 0 if parallel is None else parallel.rank)
    ],
    # the command's own start: its ranks started (before the parse), its run led (after it)
    "mmgen.cli": [("early_ranks", lambda *_, **__: 0)],
    "mmgen.parallel.lead": [("run_led", lambda *_, **__: 0)],
    # the job: rank 0's text encoded and shared (the others wait in it), the denoise loop, and the first
    # Ulysses exchange's call (host time: the collective itself runs on the GPU's stream)
    "mmgen.parallel.share": [
        ("share_reads", lambda split, modules, layout: layout.rank),
        ("from_first_rank", lambda compute, layout: layout.rank),
    ],
    "pipelines.denoise": [("denoise", lambda *args, **_: args[4].layout.rank)],
    "mmgen.parallel.attention": [("qkv_to_heads", _rank_now)],
    # the kernels' set-up thread beside the load (its two parts; the thread's rank is the process's)
    "mmgen.layers.kernel_set_up": [
        ("triton_set_up", lambda *_, **__: _process_rank()),
        ("library_set_up", lambda *_, **__: _process_rank()),
    ],
}


def _process_rank() -> int:
    """This process's rank by its name (mmgen-rankN; the command's own process is rank 0)."""
    import multiprocessing

    name = multiprocessing.current_process().name
    return int(name.removeprefix("mmgen-rank")) if name.startswith("mmgen-rank") else 0


def _stamped_exit(real_exit):
    """os._exit stamping 'exit' in its process (rank 0: the command's; rank N: mmgen-rankN's, where it ends
    itself rather than with the command)."""

    def stamped(status: int) -> None:
        _stamp(_process_rank(), "exit")
        real_exit(status)

    return stamped


if os.environ.get(STAMPS):  # in the command and in each started rank (this file is their main module)
    sys.meta_path.insert(0, _WrapOnImport())
    os._exit = _stamped_exit(os._exit)


def run_once(argv: list[str], profile: str | None = None, skip: str | None = None) -> tuple[float, dict, str]:
    """One command: its wall (until its exit and its pipes' end, as a shell's `$(...)` sees it), each
    process's stamps (seconds from the start; the command's 'waited' and 'eof': when its exit and the
    end of its pipes were seen here), and its seconds line (+ NCCL's init timings, profiles)."""
    import subprocess
    import threading

    began = time.time()
    process = subprocess.Popen(
        [sys.executable, __file__, "--command", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            STAMPS: "1",
            **({PROFILED: profile} if profile else {}),
            **({SKIPPED: skip} if skip else {}),
        },
    )
    streams: dict = {}
    ends: list[float] = []

    def read(name: str, stream) -> None:
        streams[name] = stream.read()  # until every process holding the pipe closed it
        ends.append(time.time())

    readers = [
        threading.Thread(target=read, args=item)
        for item in (("out", process.stdout), ("err", process.stderr))
    ]
    for reader in readers:
        reader.start()
    process.wait()
    waited = time.time()
    for reader in readers:
        reader.join()
    wall = time.time() - began
    if process.returncode != 0:
        sys.exit(streams["err"][-3000:])
    stamps: dict = {}
    for rank, name, at in re.findall(r"@stamp (\d+) (\S+) ([\d.]+)", streams["err"]):
        stamps.setdefault(int(rank), {}).setdefault(name, float(at) - began)
    stamps.setdefault(0, {}).update(waited=waited - began, eof=max(ends) - began)
    lines = (streams["out"] + streams["err"]).splitlines()
    seconds = next(x for x in lines if x.startswith("seconds: "))
    # NCCL >= 2.23 with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT: each communicator's init split (kernels, alloc,
    # bootstrap, topo, connections...), printed under the run when present
    nccl = [x.split("NCCL INFO ", 1)[-1] for x in lines if "Init timings" in x]
    profiled = [f"rank {x[9:]}" for x in sorted(lines, key=lambda x: x[:11]) if x.startswith("@profile ")]
    return wall, stamps, "\n     ".join([seconds, *nccl, *profiled])


def main() -> None:
    import argparse
    import tempfile

    if sys.argv[1:2] == ["--command"]:
        from mmgen.cli import console

        sys.argv = ["mmgen", *sys.argv[2:]]
        console()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", help="a stamped function (e.g. denoise) whose first call every process "
                        "profiles: its 20 functions of most own time per rank, seconds own / total, calls")  # fmt: skip
    parser.add_argument("--size", nargs=3, type=int, default=(480, 832, 21), metavar=("H", "W", "F"))
    parser.add_argument("--ab", metavar="MODULE:FUNCTION", help="an A/B instead: runs alternate with and without "
                        "the function (a no-op in every process); each run's wall and seconds line, then medians")  # fmt: skip
    parser.add_argument(
        "--names", help="comma list of the stamps to show (default: the join, load and first step's)"
    )
    parser.add_argument("--exit", action="store_true", help="the command's end instead: when it called os._exit, "
                        "when its exit and its pipes' end were seen")  # fmt: skip
    args = parser.parse_args()
    out = os.path.join(tempfile.mkdtemp(prefix="mmgen-timeline-"), "x.mp4")
    height, width, frames = args.size
    argv = ["generate", "a red circle", "--model", args.model, "--device", args.device, "--steps", "1"]
    argv += ["--height", str(height), "--width", str(width), "--frames", str(frames), "--out", out]
    argv += ["--gpus", str(args.gpus)]
    names = (
        "early_ranks+",
        "early_ranks-",
        "run_led+",
        "init_process+",
        "init_process-",
        "init_layout-",
        "load_pipeline+",
        "settled+",
        "share_reads+",
        "load_pipeline-",
        "from_first_rank+",
        "from_first_rank-",
        "denoise+",
        "qkv_to_heads+",
        "denoise-",
        "exit",
        "waited",
        "eof",
    )
    if args.names:
        names = tuple(args.names.split(","))
    run_once(argv)  # untimed: the host's first run on several GPUs
    if args.exit:
        exits(argv, out, args.runs)
        return
    if args.ab:
        walls: dict = {"with": [], "without": []}
        for index in range(args.runs):
            for arm in walls:
                os.remove(out)
                wall, _, seconds = run_once(argv, skip=args.ab if arm == "without" else None)
                walls[arm].append(wall)
                print(f"{index + 1:<4} {arm:<8} {wall:6.2f}  {seconds}")
        for arm, values in walls.items():
            print(f"{arm} {args.ab}: median {statistics.median(values):.2f} s of {len(values)} runs")
        return
    print(
        f"{'run':<4} {'rank':<5}" + "".join(f"{n.replace('_', '')[:11]:>12}" for n in names) + f"{'wall':>8}"
    )
    for index in range(args.runs):
        os.remove(out)
        wall, stamps, seconds = run_once(argv, args.profile if index == args.runs - 1 else None)
        for rank in sorted(stamps):
            cells = "".join(f"{stamps[rank].get(n, float('nan')):12.2f}" for n in names)
            print(f"{index + 1:<4} {rank:<5}{cells}{wall:8.2f}")
        print(f"     {seconds}")


def exits(argv: list[str], out: str, runs: int) -> None:
    """--exit: per run, when the command called os._exit (after its lines), when its exit and its pipes' end
    were seen here (seconds from its start), and the median of its own exit (os._exit to its exit seen)."""
    own = []
    print(f"{'run':<4} {'wall':>6} {'exit':>6} {'waited':>7} {'eof':>6}")
    for index in range(runs):
        os.remove(out)
        wall, stamps, _ = run_once(argv)
        first = stamps[0]
        print(f"{index + 1:<4} {wall:6.2f} {first['exit']:6.2f} {first['waited']:7.2f} {first['eof']:6.2f}")
        own.append(first["waited"] - first["exit"])
    print(f"the command's own exit: median {statistics.median(own):.2f} s of {runs} runs")


if __name__ == "__main__":
    main()
