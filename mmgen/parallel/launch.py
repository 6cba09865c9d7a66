"""Worker launch: N processes (NCCL on CUDA, gloo on CPU), each with its ParallelLayout; or torchrun's.

`run_parallel(fn, config, *args)` spawns config.world_size processes, initializes torch.distributed
in each (collective timeout set, so no rank waits forever), builds the layout once with init_layout
and calls fn(layout, *args); rank 0's return value comes back. When any rank fails, the launcher
stops every other rank at once and raises one MmgenError naming the rank and its error. A rank that
hangs (stopped, or stuck with its interpreter frozen) is found by its missing heartbeat: every rank
sends one every BEAT_S, and a rank silent for LIVENESS_S fails the run as a killed rank would,
well before the collective timeout its peers wait under. Processes started earlier (standby.py:
spawned before the launcher parsed, their world joined meanwhile) can be given instead
(`started=`): the run is handed to them when they fit it. Their world may still be joining in a thread
then: a run with `settles=True` gets a PendingLayout and settles it itself (`settled`) once its first
work is done (a loader, after reading its weights), so the world's NCCL set-up overlaps that work.

Under torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment) the processes already exist:
`layout_from_environment(config)` initializes this one and returns its layout.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mmgen.errors import ValidationError, one_line
from mmgen.parallel.layout import ParallelConfig, ParallelLayout, init_layout
from mmgen.parallel.process import (
    DEFAULT_TIMEOUT_S,
    die_with_parent,
    free_port,
    nccl_defaults,
    torchrun_environment,
)
from mmgen.parallel.rank_watch import BEAT_S, STOP_GRACE_S, RankFailed, collect, stop, where


def check_devices(config: ParallelConfig, device_type: str) -> None:
    """--gpus larger than the visible GPUs is an error before anything loads (CPU: gloo processes, any count)."""
    if device_type != "cuda":
        return
    visible = torch.cuda.device_count()
    if config.world_size > visible:
        raise ValidationError(
            f"--gpus {config.world_size} asks for more GPUs than this machine shows ({visible} visible; "
            "CUDA_VISIBLE_DEVICES limits them)"
        )


def check_model_heads(
    config: ParallelConfig, heads: int | None, *, ring: bool = True, title: str = "the model"
) -> None:
    """Before any rank spawns or loads: Ulysses splits the model's `heads` (its family reads them from
    its config; None: not known before loading) over config's Ulysses degree, and a model whose
    attention runs no ring (`ring` False: --sp is its Ulysses degree) refuses --ring. The checks
    every rank's pipeline makes again (ParallelLayout.check_heads, PackedUlysses.plan), said with
    the flags and the values that fit. title: how the message names the model."""
    if config.ring > 1 and not ring:
        fits = f", --sp dividing its {heads} attention heads ({_divisors(heads)})" if heads else ""
        raise ValidationError(f"--ring {config.ring}: {title}'s attention runs no ring; use --ring 1{fits}")
    if heads is None or heads % config.ulysses == 0:
        return
    layout = ParallelLayout(
        world_size=config.world_size,
        sp_degree=config.sp,
        ring_degree=config.ring,
        cfg_degree=2 if config.cfg else 1,
    )
    if ring:
        layout.check_heads(heads)  # its message names --ring and the Ulysses degrees that fit
    cfg = " with --cfg-parallel" if config.cfg else ""
    gpus = _divisors(heads, 2 if config.cfg else 1)
    raise ValidationError(
        f"--gpus {config.world_size}{cfg}: {title}'s {heads} attention heads do not split over Ulysses "
        f"degree {config.ulysses} (its attention runs Ulysses only, no ring: --sp is the Ulysses degree); "
        f"allowed: --sp {_divisors(heads)}, so --gpus {gpus}{cfg}"
    )


def _divisors(heads: int, times: int = 1) -> str:
    """'1, 2, 4 or 8': the Ulysses degrees that split `heads` (each times `times`)."""
    found = [str(d * times) for d in range(1, heads + 1) if heads % d == 0]
    return found[0] if len(found) == 1 else f"{', '.join(found[:-1])} or {found[-1]}"


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def init_process(
    rank: int,
    world_size: int,
    device_type: str,
    timeout_s: float,
    address: str | None = None,
    first_device: int = 0,
) -> torch.device:
    """Join the process group (env:// when address is None) and pick this rank's device (under NCCL
    bound to it: eager communicator set-up)."""
    device = torch.device("cpu")
    if device_type == "cuda":
        nccl_defaults()  # (a started rank set them at its start, before NCCL's first call)
        local = int(os.environ.get("LOCAL_RANK", rank)) if address is None else first_device + rank
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device_type),
        init_method=address or "env://",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        # NCCL bound to this rank's GPU: the world's communicator is made here, not at its first
        # collective, and init_layout's groups split it (ncclCommSplit) rather than each bootstrapping
        # its own: part of the group's start, never a job's.
        device_id=device if device_type == "cuda" else None,
    )
    return device


def layout_from_environment(
    config: ParallelConfig, device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S
) -> ParallelLayout:
    """Under torchrun: initialize this process from RANK / WORLD_SIZE and return its layout."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != config.world_size:
        raise ValidationError(
            f"torchrun started {world} processes but the parallel settings need {config.world_size}"
        )
    check_devices(config, device_type)
    device = init_process(rank, world, device_type, timeout_s)
    return init_layout(config, device)


def resolve_layout(
    parallel: ParallelConfig | ParallelLayout | PendingLayout | None, device_type: str
) -> ParallelLayout | PendingLayout:
    """The layout a pipeline runs with: given, built from an initialized world or torchrun's, or single
    (a PendingLayout as it is: the loader settles it after its weights, `settled`)."""
    if parallel is None:
        return ParallelLayout.single()
    if isinstance(parallel, ParallelLayout | PendingLayout):
        return parallel
    if parallel.world_size == 1:
        return ParallelLayout.single()
    if dist.is_initialized():
        return init_layout(parallel, torch.device(device_type) if device_type != "cuda" else None)
    if torchrun_environment():
        return layout_from_environment(parallel, device_type)
    raise ValidationError(
        f"parallel config of {parallel.world_size} processes in a single process: start the workers "
        "with mmgen.parallel.launch.run_parallel, `mmgen generate --gpus N`, or torchrun"
    )


class PendingLayout:
    """A rank's ParallelLayout whose world is still being joined (in a started process's thread,
    standby.PendingSetup): world_size is known now, `settled` waits for the rest. A loader resolves it
    after reading its weights (mmgen.pipelines' from_pretrained), so the NCCL set-up runs beside the load."""

    def __init__(
        self, world_size: int, rank: int, resolve: Callable[[], ParallelLayout], board: Any = None
    ) -> None:
        self.world_size = world_size
        self.rank = rank
        self.board = board  # the world's read_board.ReadBoard (its ranks take the load's pieces from it)
        self._resolve = resolve
        self._layout: ParallelLayout | None = None
        self.waited_s = 0.0  # how long result() waited for the world (the part of a load it did not hide)

    def result(self) -> ParallelLayout:
        if self._layout is None:
            began = time.perf_counter()
            self._layout = self._resolve()
            self.waited_s = time.perf_counter() - began
        return self._layout


def settled(layout: ParallelLayout | PendingLayout) -> ParallelLayout:
    """layout, its world joined: a PendingLayout's result (waiting for it), any other as it is."""
    return layout.result() if isinstance(layout, PendingLayout) else layout


@dataclass(frozen=True)
class World:
    """One torch.distributed world among those a launcher starts (render groups start several)."""

    index: int
    config: ParallelConfig
    device_type: str
    address: str
    timeout_s: float
    first_device: int
    settles: bool = False  # fn takes a PendingLayout from started processes and settles it itself
    # forked ranks (CPU only) run on one torch thread: libgomp's thread pool does not survive fork, and
    # once the launcher has run an OpenMP region on several threads, a child entering one may hang
    # (seen: the world's warm-up, filling its first large tensor)
    forked: bool = False


def _beat(world: World, rank: int, results: Any, done: threading.Event) -> None:
    """Tell the launcher this rank is alive at once, then every BEAT_S until `done` (collectives release
    the GIL, so a rank waiting in one still beats; a stopped or frozen process does not). At once: the
    launcher judges silence only after a first beat (a rank's start may take long), so a rank that hung
    within its first BEAT_S was never seen."""
    results.put(("alive", world.index, rank))
    while not done.wait(BEAT_S):
        results.put(("alive", world.index, rank))


def run_rank(
    world: World, rank: int, fn: Callable[..., Any], args: tuple, results: Any, early: Any = None
) -> None:
    """One rank: join `world` (or take the world a started process joins early: early, its
    standby.PendingSetup), run fn(layout, *args) and report to the launcher. With world.settles and an
    early world, layout is a PendingLayout that fn settles itself."""
    die_with_parent()
    if world.forked:
        torch.set_num_threads(1)  # before any op: the layout's warm-up is the first (see World.forked)
    done = threading.Event()
    beats = threading.Thread(target=_beat, args=(world, rank, results, done), daemon=True)
    beats.start()
    try:
        value = fn(_rank_layout(world, rank) if early is None else started_layout(world, rank, early), *args)
        # By value: through the queue a tensor would go as a shared-memory descriptor this rank serves,
        # and the rank may have exited before the launcher reads it.
        results.put(("ok", world.index, rank, pickle.dumps(value) if rank == 0 else None))
    except KeyboardInterrupt:  # Ctrl-C reaches the terminal's whole group: the launcher's interrupt too
        results.put(("interrupted", world.index, rank))
        raise SystemExit(1) from None
    except BaseException as error:  # noqa: BLE001 - every failure is reported to the launcher as one line
        results.put(("error", world.index, rank, one_line(error, typed=True), traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        done.set()
        beats.join()
        # a started process (early) ends after its launcher, its world with it, unasked
        # (standby.end_after_launcher); a spawned one tears its world down first
        if dist.is_initialized() and early is None:
            dist.destroy_process_group()


def _rank_layout(world: World, rank: int) -> ParallelLayout:
    """This rank's device set and, over several ranks, its process group joined and its layout made."""
    layout = ParallelLayout.single(world.device_type)
    if world.device_type == "cuda":
        torch.cuda.set_device(world.first_device + rank)
        layout = ParallelLayout.single(torch.device("cuda", world.first_device + rank))
    if world.config.world_size > 1:
        device = init_process(
            rank,
            world.config.world_size,
            world.device_type,
            world.timeout_s,
            world.address,
            world.first_device,
        )
        layout = init_layout(world.config, device)
    return layout


def started_layout(world: World, rank: int, early: Any) -> ParallelLayout | PendingLayout:
    """The layout of a rank whose world was joined from its start (early: its standby.PendingSetup,
    maybe still joining): a PendingLayout that fn settles itself when world.settles, else the joined
    layout (waited for)."""
    if world.device_type == "cuda":  # this thread's device (the joining thread sets its own)
        torch.cuda.set_device(world.first_device + rank)

    def resolve() -> ParallelLayout:
        return _early_layout(world, early.result())

    layout = PendingLayout(world.config.world_size, rank, resolve, early.board)
    return layout if world.settles else layout.result()


def _early_layout(world: World, early: Any) -> ParallelLayout:
    """The layout a started process made before its work came; its set-up's error raised here."""
    if early.error is not None:
        raise early.error
    if early.device_type != world.device_type:
        raise ValidationError(
            f"this rank joined its world on {early.device_type} before its work came; the run is on "
            f"{world.device_type}"
        )
    return early.layout


def run_parallel(
    fn: Callable[..., Any],
    config: ParallelConfig,
    *args: Any,
    device_type: str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    start_method: str = "spawn",
    started: Any = None,
    settles: bool = False,
) -> Any:
    """Run fn(layout, *args) on config.world_size new processes; rank 0's result, or RankFailed.

    fn and args must pickle (a module-level function). A failing rank stops all ranks within
    about a second: the launcher terminates the others rather than let them wait for the timeout.
    start_method: "spawn" (fresh interpreters; the only safe choice once CUDA is initialized) or
    "fork" (CPU only: the workers inherit the imported modules, so they start in milliseconds; each
    runs on one torch thread, World.forked).
    started: processes spawned earlier (mmgen.parallel.standby.StartedRanks) that become the ranks
    when they fit the run (as many; their early world, if any, this one), their imports and world's
    set-up done while this process prepared the run; else new ones. settles: fn may get a PendingLayout
    (from started processes still joining their world) and settles it itself (`settled`) after its
    first work, which then overlaps the world's set-up; else fn gets the layout ready.
    """
    context = multiprocessing.get_context(start_method)
    return run_worlds(
        fn,
        config,
        1,
        args,
        device_type=device_type,
        timeout_s=timeout_s,
        context=context,
        started=started,
        settles=settles,
    )[0]


def hand_over(
    started: Any, places: list[tuple[int, tuple[World, int]]], fn: Callable[..., Any], args: tuple, count: int
) -> None:
    """Each started process at position p (places: (p, (world, rank))) runs run_rank for its world and
    rank; RankFailed naming one that ended before its work came. count: the worlds (how ranks are named)."""
    for position, (world, rank) in places:
        try:
            started.assign(position, run_rank, (world, rank, fn, args))
        except OSError:  # its end of the pipe is closed: the process ended while it started up
            process = started.processes[position - started.first]
            process.join(STOP_GRACE_S)
            raise RankFailed(
                f"{where(world.index, rank, count)} ended before its work came (exit code {process.exitcode})"
            ) from None


def run_worlds(
    fn: Callable[..., Any],
    config: ParallelConfig,
    count: int,
    args: tuple,
    *,
    device_type: str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    context: Any = None,
    started: Any = None,
    settles: bool = False,
) -> list[Any]:
    """`count` independent worlds of config.world_size processes each (world i on GPUs i*W ... i*W+W-1).

    Every rank runs fn(layout, *args) (args may hold multiprocessing queues of `context`, shared by
    all worlds, unless the ranks were `started` earlier: their args go through a pipe); returns each
    world's rank-0 result. Any failing rank stops every process of every world and raises RankFailed
    naming the world and rank.
    """
    context = context or multiprocessing.get_context("spawn")
    check_devices(ParallelConfig(sp=config.world_size * count), device_type)
    if context.get_start_method() == "fork" and device_type == "cuda":
        raise ValidationError("parallel launch: start method 'fork' is CPU only; CUDA workers are spawned")
    # (a leading StartedRanks, whose rank 0 is this process, is mmgen.parallel.lead's to run)
    use_started = started is not None and not started.leads and started.fits(config, count, timeout_s)
    # the world the started processes joined already, if they did; else a fresh address per world
    early_address = started.world.address if use_started and started.world is not None else None
    places = [  # (world, rank) in process order: position p runs on GPU p
        (world, rank)
        for world in (
            World(
                index,
                config,
                device_type,
                early_address or f"tcp://127.0.0.1:{free_port()}",
                timeout_s,
                index * config.world_size,
                settles,
                forked=context.get_start_method() == "fork",
            )
            for index in range(count)
        )
        for rank in range(config.world_size)
    ]
    if use_started:
        processes, results = started.processes, started.results
        hand_over(started, list(enumerate(places)), fn, args, count)
    else:  # none started, or not fitting this run
        if started is not None:
            started.close()  # now: on CUDA they hold a context and communicators on the GPUs the new ranks take
        results = context.Queue()
        processes = [
            context.Process(
                target=run_rank,
                args=(world, rank, fn, args, results),
                name=f"mmgen-w{world.index}-rank{rank}",
            )
            for world, rank in places
        ]
        for process in processes:
            process.start()
    try:
        values = collect(processes, [(world.index, rank) for world, rank in places], results, count)
    except BaseException:
        stop(processes, grace_s=0.0)  # a group that lost a rank has nothing left to finish
        raise
    stop(processes)
    return values
