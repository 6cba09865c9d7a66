"""Rank processes started before their work is known, so that their start-up overlaps the launcher's.

`mmgen generate --gpus N` knows it needs N ranks as soon as it reads its flags, but its own parse and
request checks import torch and the request (seconds on a GPU host) before it can say what to run.
Spawned only then, each rank would pay the same imports again, then its process group's set-up
(NCCL communicators, warm_up), one after the other. `StartedRanks` spawns the N processes first:
given the `EarlyWorld` the flags ask for, each starts joining it (init_process, init_layout with its
warm-up) in a thread (PendingSetup) as soon as torch is imported, imports the rest of its `preload`
modules (what its work needs) beside it while the launcher parses (on a GPU its CUDA context is made
from its start, beside `import torch`: mmgen.parallel.cuda_context), and takes its assignment while the
thread goes on: a run that settles its layout itself (run_parallel(..., settles=True), `generate`'s
load) reads its weights meanwhile. `run_parallel(..., started=ranks)` hands rank r its world and
function through a pipe instead of spawning, when the started processes fit the run (as many, the same
layout; else it spawns its own). Only small values cross (the function by reference, the flags, the
request): never a model or a tensor. Processes the launcher did not use (a refused request) are
stopped on close.

This module imports nothing heavy at import: a started process sets its die-with-parent signal
before it imports torch.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

from mmgen.parallel.cuda_context import start_primary_context
from mmgen.parallel.process import die_with_parent
from mmgen.parallel.read_board import ReadBoard

# A bound on the wait for the die-with-parent signal once the launcher's exit began (end_after_launcher): its
# teardown (a GPU's context) takes ~0.5 s; past this the rank ends itself
LAUNCHER_TEARDOWN_S = 10.0


@dataclass(frozen=True)
class EarlyWorld:
    """The world the started processes join before their work comes, as the flags ask for it:
    --gpus, --sp (None: its default), --ring, --cfg-parallel; address: its rendezvous; timeout_s:
    its collectives' timeout."""

    gpus: int
    sp: int | None
    ring: int
    cfg: bool
    address: str
    timeout_s: float

    def config(self) -> Any:
        """The ParallelConfig of these flags (a ValidationError when they do not make one)."""
        from mmgen.parallel.layout import ParallelConfig  # imports torch

        return ParallelConfig.for_gpus(self.gpus, sp=self.sp, cfg=self.cfg, ring=self.ring)


@dataclass(frozen=True)
class EarlySetup:
    """What a started process made of its EarlyWorld: its layout and device type, or the error; and
    when (time.time()) the join began (torch imported), its device was set (its CUDA context made),
    its process group was made (init_process: the rendezvous, the world's communicator), its world was
    joined (init_layout: the groups and their warm-up) and its preload imports were done
    (benchmarks/rank_start.py)."""

    layout: Any = None  # ParallelLayout
    device_type: str = ""
    error: BaseException | None = None
    began_at: float = 0.0
    device_at: float = 0.0
    process_at: float = 0.0
    joined_at: float = 0.0
    imported_at: float = 0.0

    def times(self, since: float = 0.0) -> dict[str, float]:
        """The stamps by name (began, device, process, joined, imported), in seconds from `since`."""
        stamps = ("began", "device", "process", "joined", "imported")
        return {name: getattr(self, f"{name}_at") - since for name in stamps}


class StartedRanks:
    """`count` ranks waiting for their assignment; position p becomes the rank on GPU p.

    Each is a spawned process, or, when the launcher leads (`end_stuck` given), position 0 is the
    launcher's own process (mmgen.parallel.lead) and positions 1 ... count - 1 are spawned.
    Use as a context manager (or call close()): leaving it stops every process still running."""

    def __init__(
        self,
        count: int,
        preload: Sequence[str] = (),
        device: str = "cpu",
        world: EarlyWorld | None = None,
        end_stuck: Callable[[BaseException], None] | None = None,
    ) -> None:
        """device: the `--device` the run was asked for (cpu, cuda or auto); world: the world to join
        while waiting (None: only the imports). end_stuck: given, this process leads (it is rank 0 of
        `world`, which must be given, and ends once the run is done: `mmgen generate`); end_stuck(error)
        must end the process when another rank failed and rank 0 cannot return (waiting on it in an
        NCCL collective, which only its timeout would end). A start that fails part-way stops those
        started."""
        if end_stuck is not None and world is None:
            raise ValueError("a leading launcher is rank 0 of a world: give the world")
        self.world = world
        self.device = device
        self.end_stuck = end_stuck
        self._own: PendingSetup | None = None  # a leading process's own join (join_here)
        self.context = multiprocessing.get_context("spawn")
        # what the ranks report (launch.run_rank's messages); None once closed
        self.results: Any = self.context.Queue()
        self.processes: list[Any] = []
        self._outboxes: list[Any] = []
        # the pieces of the run's load, which its ranks take from one another (read_board)
        self.board = ReadBoard(self.context) if world is not None else None
        if self.leads and device != "cpu":
            # rank 0's GPU context and NCCL's kernels, beside this process's own imports
            start_primary_context(0, nccl=True)
        try:
            for position in range(self.first, count):
                inbox, outbox = self.context.Pipe(duplex=False)
                process = self.context.Process(
                    target=wait_for_work,
                    args=(position, inbox, self.results, tuple(preload), device, world, self.board),
                    name=f"mmgen-rank{position}",
                    # daemonic: a launcher whose interpreter ends the usual way (not os._exit) stops them
                    # first, rather than waiting for ranks that wait for its end (end_after_launcher)
                    daemon=True,
                )
                process.start()
                inbox.close()  # the rank's end: it alone holds it now, so a closed outbox is its EOF
                self.processes.append(process)
                self._outboxes.append(outbox)
        except BaseException:
            self.close()  # no owner holds them yet: the ones started would wait for their peers
            raise

    @property
    def leads(self) -> bool:
        """Whether this process is rank 0 (the others spawned): see __init__'s end_stuck."""
        return self.end_stuck is not None

    @property
    def first(self) -> int:
        """The position of processes[0]: 1 when this process leads (it is position 0), else 0."""
        return 1 if self.leads else 0

    @property
    def count(self) -> int:
        """The ranks these are: the processes, and this one when it leads."""
        return self.first + len(self.processes)

    def fits(self, config: Any, worlds: int, timeout_s: float) -> bool:
        """Whether these ranks can be those of `worlds` worlds of `config` (a ParallelConfig): as many
        of them, and, when they joined an early world, that world is this one."""
        if self.count != config.world_size * worlds:
            return False
        if self.world is None:
            return True
        if worlds != 1 or self.world.timeout_s != timeout_s:
            return False
        try:
            return self.world.config() == config
        except Exception:  # noqa: BLE001 - flags that make no config: the launcher's parse refused them already
            return False

    def assign(self, position: int, target: Callable[..., Any], args: tuple) -> None:
        """The process at `position` runs target(*args, results, early) (early: its EarlySetup, None
        without an early world); args must pickle (no queues, no tensors)."""
        outbox = self._outboxes[position - self.first]
        outbox.send((target, args))
        outbox.close()

    def join_here(self) -> PendingSetup:
        """A leading process's join of its world as rank 0, begun in a thread at the first call (as soon
        as the command is parsed: its imports are this process's by then, and what is left of the
        command's start overlaps the join)."""
        if not self.leads:
            raise ValueError("only a leading process joins its world itself")
        if self._own is None:
            importlib.import_module("mmgen.parallel.launch")  # the join's imports, not the thread's
            self._own = PendingSetup(0, self.device, self.world, self.board)
        return self._own

    def close(self, wait: bool = True) -> None:
        """Stop every process still running (an unassigned one may still be importing: no grace) and wait
        for them. wait False: left to end with this process, which ends now (a leading one): a rank that
        reported ends after it (end_after_launcher), one never assigned at its closed pipe, and
        die_with_parent ends any other once this process is gone."""
        for outbox in self._outboxes:
            outbox.close()
        running = self.processes if wait else []
        for process in running:
            if process.is_alive():
                process.terminate()
        for process in running:
            process.join()
        if self.board is not None:
            self.board.close()
        if self.results is not None:  # closing twice is closing once
            self.results.close()
            self.results.cancel_join_thread()  # nothing this process put: no feeder to wait for
            # The queue's semaphores are unlinked when it is freed: now, not never (`mmgen generate`
            # ends with os._exit, and the resource tracker then warned of "leaked semaphore objects").
            self.results = None

    def __enter__(self) -> StartedRanks:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(wait=not self.leads)


class PendingSetup:
    """A started process's EarlySetup in the making: its world joined in a thread from construction on
    (daemon: a process the launcher did not use ends without it); result() waits for it."""

    def __init__(self, position: int, device: str, world: EarlyWorld, board: ReadBoard | None = None) -> None:
        self.board = board  # the world's shared pieces of its load (launch.PendingLayout hands it on)
        self._setup: EarlySetup | None = None
        self._imported_at = 0.0
        self._thread = threading.Thread(
            target=self._join,
            args=(position, device, world),
            name="mmgen-join-world",
            daemon=True,
        )
        self._thread.start()

    def _join(self, position: int, device: str, world: EarlyWorld) -> None:
        self._setup = join_early_world(position, device, world)

    def imported(self) -> None:
        """The process's preload imports are done (they go on beside the join): when, for EarlySetup."""
        self._imported_at = time.time()

    def result(self) -> EarlySetup:
        """The EarlySetup (its error kept in it, as join_early_world keeps it), once the thread is done."""
        self._thread.join()
        if self._setup is None:  # the thread died of a BaseException join_early_world does not keep
            return EarlySetup(error=RuntimeError("this rank's world set-up ended without a result"))
        return replace(self._setup, imported_at=self._imported_at)


def wait_for_work(
    position: int,
    inbox: Any,
    results: Any,
    preload: tuple[str, ...],
    device: str,
    world: EarlyWorld | None,
    board: ReadBoard | None = None,
) -> None:
    """A started process: start joining the early world (if given) as soon as what the join needs is
    imported (torch), import the rest beside it, take the assignment (or end on EOF: the launcher went
    on without it) and run it with the PendingSetup (None without a world)."""
    die_with_parent()
    if world is not None and device != "cpu":
        # the GPU's CUDA context and NCCL's kernels made beside `import torch`, not after it
        # (mmgen.parallel.cuda_context): the world's join then begins with them there
        start_primary_context(position, nccl=True)
    try:
        early = None
        if world is not None:
            # the join's own imports (torch): the set-up (CUDA, NCCL) then overlaps the rest of preload
            importlib.import_module("mmgen.parallel.launch")
            early = PendingSetup(position, device, world, board)
        for name in preload:
            importlib.import_module(name)
        if early is not None:
            early.imported()
        target, args = inbox.recv()
    except (EOFError, KeyboardInterrupt):
        return  # the launcher went on without this process (a refused request) or was interrupted
    target(*args, results, early)
    end_after_launcher(results)


def end_after_launcher(results: Any) -> None:
    """A started rank that reported: it ends once the launcher has, not before.

    Why: a rank's teardown (its CUDA context, NCCL's state; ~1 s with Wan2.1-14B's 28 GB) run beside the
    launcher's made the launcher's own exit 0.87 s against 0.52 s alone on 4x H200 (RESULTS.md 28).
    How: its report is flushed to the launcher's pipe and its output streams let go (pointed at
    /dev/null: a reader of the command's pipes sees their end with the launcher's exit); then it waits
    for the launcher's end, where its die-with-parent SIGKILL comes once the launcher's exit has released
    its files (its GPU state), with a bounded wait (LAUNCHER_TEARDOWN_S) after the launcher's sentinel
    closed. A launcher that does not end (run_parallel with started ranks) stops the rank itself. So the
    command ends as soon as its own teardown is done; its ranks give their GPUs' memory back within about
    a second after it."""
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    parent = multiprocessing.parent_process()
    if parent is not None:
        parent.join()  # the launcher's exit closed its end of the sentinel: its signal follows
        time.sleep(LAUNCHER_TEARDOWN_S)
    os._exit(0)


def join_early_world(position: int, device: str, world: EarlyWorld) -> EarlySetup:
    """Rank `position` of `world`: its process group joined and its layout made (with the groups'
    warm-up), as launch.run_rank would after its assignment. An error is kept for the assignment:
    the rank reports it then, as its own."""
    import torch

    from mmgen.parallel.launch import init_process
    from mmgen.parallel.layout import init_layout

    # as pipelines.devices.resolve_device: 'auto' is cuda when there is one (a 'cuda' that is not
    # there is refused by the launcher's own checks before any rank gets work)
    times = {"began_at": time.time()}
    device_type = "cuda" if device != "cpu" and torch.cuda.is_available() else "cpu"
    try:
        config = world.config()
        if device_type == "cuda":  # as init_process does first; apart, to time the CUDA context alone
            torch.cuda.set_device(position)
        times["device_at"] = time.time()
        rank_device = init_process(position, config.world_size, device_type, world.timeout_s, world.address)
        times["process_at"] = time.time()
        layout = init_layout(config, rank_device)
        return EarlySetup(layout, device_type, joined_at=time.time(), **times)
    except Exception as error:  # noqa: BLE001 - reported by the rank once it has its work
        return EarlySetup(device_type=device_type, error=error, joined_at=time.time(), **times)
