"""One question: where do the seconds of a 2-GPU (or --gpus N) world's join go, and does loading NCCL's kernels
beside the imports (a one-rank communicator made through libnccl in a thread from the process's start) shorten it?

    python3 benchmarks/world_join.py --runs 3        # a 2-GPU host
    python3 benchmarks/world_join.py --gpus 4 --modes preload,NCCL_CUMEM_ENABLE=0   # 4 ranks, as mmgen's
    python3 benchmarks/world_join.py --modes preload preload,NCCL_CUMEM_ENABLE=0   # NCCL settings per mode
    python3 benchmarks/world_join.py --modes preload preload,WORLD_JOIN_EXIT=destroy     # the exit's cost

Each run starts --gpus (default two) fresh ranks at once (subprocesses of this file), each as a started mmgen rank does: its
GPU's primary context made in a thread from its start (mmgen.parallel.cuda_context), torch imported, the
process group joined bound to its GPU (eager NCCL communicator), then init_layout's warm-up collectives, each
timed on its own (synchronized). Mode `preload` also makes and destroys a one-rank NCCL communicator in that
thread (same libnccl.so.2 as torch's, loaded first by path). Prints seconds from the rank's start per rank and
NCCL's own "Init timings" split (NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT); modes alternate run by run.
Each rank then ends with os._exit as `generate --gpus N`'s command does, its world live (WORLD_JOIN_EXIT=destroy
in a mode: destroy_process_group first, timed): `ended` is from its last line's arrival to its exit.
"""

from __future__ import annotations

import json
import os
import sys
import time

BEGAN = time.time()


def _early(ordinal: int, preload: bool, stamps: dict) -> None:
    from mmgen.parallel.cuda_context import load_nccl_kernels, retain_primary_context

    stamps["context"] = (retain_primary_context(ordinal), time.time() - BEGAN)
    if preload:  # as mmgen.parallel.cuda_context.start_primary_context(ordinal, nccl=True), stamped
        stamps["preload"] = (load_nccl_kernels(ordinal), time.time() - BEGAN)


def rank_main(rank: int, address: str, preload: bool, world: int) -> None:
    import threading

    stamps: dict = {"start": time.time() - BEGAN}
    early = threading.Thread(target=_early, args=(rank, preload, stamps), daemon=True)
    early.start()
    import torch
    import torch.distributed as dist

    stamps["torch"] = time.time() - BEGAN
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    stamps["init+"] = time.time() - BEGAN
    dist.init_process_group("nccl", init_method=address, rank=rank, world_size=world, device_id=device)
    stamps["init-"] = time.time() - BEGAN
    early.join()
    elements = 1 << 20
    for size in (1, elements):
        chunk = torch.zeros(world * size, device=device)
        for name, op in (
            ("broadcast", lambda c: dist.broadcast(c, src=0)),
            (
                "all_gather",
                lambda c: dist.all_gather(list(torch.empty_like(c).chunk(world)), c[: c.numel() // world]),
            ),
            ("all_to_all", lambda c: dist.all_to_all_single(torch.empty_like(c), c)),
        ):
            tick = time.time()
            op(chunk)
            torch.cuda.synchronize(device)
            stamps[f"{name}{'_large' if size > 1 else ''}"] = time.time() - tick
    stamps["warm-"] = time.time() - BEGAN
    # the end as `mmgen generate --gpus N`'s command ends (os._exit, its world live), or after a destroy
    destroy = os.environ.get("WORLD_JOIN_EXIT") == "destroy"
    if destroy:
        tick = time.time()
        dist.destroy_process_group()
        stamps["destroy"] = time.time() - tick
    print("@json " + json.dumps(stamps), flush=True)
    os._exit(0)


def run_once(mode: str, world: int) -> list[tuple[dict, list[str]]]:
    """Every rank of one run; mode: 'plain', 'preload', or either with NCCL settings after a comma
    ('preload,NCCL_CUMEM_ENABLE=0')."""
    import socket
    import subprocess

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    kind, *settings = mode.split(",")
    env = {**os.environ, "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"}
    env.update(setting.split("=", 1) for setting in settings)
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--rank",
                str(rank),
                f"tcp://127.0.0.1:{port}",
                str(int(kind == "preload")),
                str(world),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in range(world)
    ]
    readers = [_Reader(process) for process in processes]
    found = []
    for reader in readers:
        out = reader.result()
        stamps = json.loads(next(x for x in out.splitlines() if x.startswith("@json "))[6:])
        stamps["ended"] = reader.ended
        nccl = [x.split("NCCL INFO ", 1)[-1] for x in out.splitlines() if "Init timings" in x]
        found.append((stamps, nccl))
    return found


class _Reader:
    """A rank's output read in a thread: `ended`, seconds from its @json line's arrival to its exit."""

    def __init__(self, process) -> None:
        import threading

        self.process = process
        self.lines: list[str] = []
        self.ended = float("nan")
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        arrived = None
        for line in self.process.stdout:
            self.lines.append(line)
            if line.startswith("@json "):
                arrived = time.time()
        self.process.wait()
        if arrived is not None:
            self.ended = time.time() - arrived

    def result(self) -> str:
        self.thread.join(timeout=120)
        out = "".join(self.lines)
        if self.process.returncode != 0:
            sys.exit(out[-3000:])
        return out


def _cell(stamps: dict, name: str) -> str:
    value = stamps.get(name, "-")
    value = value[1] if isinstance(value, list) else value  # (outcome, seconds)
    return f"{value:9.2f}" if isinstance(value, float) else f"{value:>9}"


def main() -> None:
    import argparse

    if sys.argv[1:2] == ["--rank"]:
        rank_main(int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1", int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--gpus", type=int, default=2, help="the world's ranks, one GPU each")
    parser.add_argument("--modes", nargs="+", default=["plain", "preload"], help="alternated run by run")
    args = parser.parse_args()
    from mmgen.parallel.cuda_context import nccl_library

    print(f"libnccl: {nccl_library()}")
    run_once("plain", args.gpus)  # untimed: the host's first
    columns = ("torch", "context", "preload", "init+", "init-", "warm-", "destroy", "ended")
    ops = [f"{n}{s}" for s in ("", "_large") for n in ("broadcast", "all_gather", "all_to_all")]
    print(
        f"{'mode':<8} {'rank':<5}"
        + "".join(f"{c:>9}" for c in columns)
        + "".join(f"{o[:14]:>15}" for o in ops)
    )
    for index in range(len(args.modes) * args.runs):
        mode = args.modes[index % len(args.modes)]
        for rank, (stamps, nccl) in enumerate(run_once(mode, args.gpus)):
            row = "".join(_cell(stamps, c) for c in columns) + "".join(f"{stamps[o]:15.3f}" for o in ops)
            print(f"{mode:<8} {rank:<5}{row}")
            for line in nccl:
                print(f"      {line}")
            if "preload" in stamps and stamps["preload"][0] is not True:
                print("      preload: NCCL's kernels not loaded early")


if __name__ == "__main__":
    main()
