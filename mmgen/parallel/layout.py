"""ParallelLayout: which process this is and which process groups it works with, as a frozen value.

Built once at start-up (one process: `ParallelLayout.single()`; several: `init_layout(ParallelConfig)`
from the torch.distributed state, which also runs each group's first collectives, warm_up, so that no
job pays their set-up), then passed explicitly from the pipeline to the model call to the
attention site, like DiTAttention. There are no module-level groups to look up; a function that
needs a group receives the layout.

Ranks: world = cfg_degree x sp_degree, rank = cfg_rank * sp_degree + sp_rank. The CFG group holds the
ranks that compute the conditional and unconditional halves of a guided step (same sp_rank); the
sequence-parallel group holds the ranks that share one sample's tokens (same cfg_rank). Inside the
SP group, sp_degree = ulysses_degree x ring_degree and sp_rank = ring_rank * ulysses_degree +
ulysses_rank: the Ulysses group (same ring_rank, adjacent ranks: the fastest links) exchanges
heads <-> sequence; the ring group (same ulysses_rank) passes key/value blocks around.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mmgen.errors import ValidationError


@dataclass(frozen=True)
class ParallelConfig:
    """What the user asks for: sp ranks per sample (ring of them passing KV blocks), and CFG parallel.

    sp = ulysses x ring; `ring` defaults to 1 (pure Ulysses). world size = sp x (2 if cfg else 1).
    """

    sp: int = 1
    ring: int = 1
    cfg: bool = False

    def __post_init__(self) -> None:
        for name in ("sp", "ring"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValidationError(f"parallel config: {name} must be a positive int, got {value!r}")
        if self.sp % self.ring:
            raise ValidationError(
                f"parallel config: ring degree {self.ring} must divide the sequence-parallel degree {self.sp}"
            )

    @property
    def world_size(self) -> int:
        return self.sp * (2 if self.cfg else 1)

    @property
    def ulysses(self) -> int:
        return self.sp // self.ring

    @staticmethod
    def for_gpus(gpus: int, sp: int | None = None, cfg: bool = False, ring: int = 1) -> ParallelConfig:
        """--gpus N [--sp S] [--cfg-parallel]: sp defaults to all ranks not taken by CFG; N must match."""
        if not isinstance(gpus, int) or gpus < 1:
            raise ValidationError(f"--gpus must be a positive int, got {gpus!r}")
        branches = 2 if cfg else 1
        if sp is None:
            if gpus % branches:
                raise ValidationError(f"--gpus {gpus} with --cfg-parallel must be even")
            sp = gpus // branches
        config = ParallelConfig(sp=sp, ring=ring, cfg=cfg)
        if config.world_size != gpus:
            raise ValidationError(
                f"--gpus {gpus} does not match --sp {sp}{' x 2 (--cfg-parallel)' if cfg else ''} = "
                f"{config.world_size} processes"
            )
        return config


@dataclass(frozen=True)
class ParallelLayout:
    """world_size = cfg_degree * sp_degree processes; groups are torch.distributed groups (None = alone)."""

    world_size: int = 1
    rank: int = 0
    device: torch.device | None = None
    sp_degree: int = 1
    sp_rank: int = 0
    sp_group: Any = None
    cfg_degree: int = 1
    cfg_rank: int = 0
    cfg_group: Any = None
    ring_degree: int = 1
    ring_group: Any = None
    ulysses_group: Any = None
    world_group: Any = None  # every rank of this layout's world (job hand-out in render groups)

    def __post_init__(self) -> None:
        if self.sp_degree < 1 or self.cfg_degree < 1 or self.cfg_degree > 2:
            raise ValidationError(
                f"parallel layout: sp_degree {self.sp_degree} must be >= 1, cfg_degree {self.cfg_degree} 1 or 2"
            )
        if self.world_size != self.sp_degree * self.cfg_degree:
            raise ValidationError(
                f"parallel layout: world_size {self.world_size} != sp_degree {self.sp_degree} "
                f"x cfg_degree {self.cfg_degree}"
            )
        if not (0 <= self.sp_rank < self.sp_degree and 0 <= self.cfg_rank < self.cfg_degree):
            raise ValidationError(
                f"parallel layout: sp_rank {self.sp_rank} / cfg_rank {self.cfg_rank} out of range"
            )
        if self.ring_degree < 1 or self.sp_degree % self.ring_degree:
            raise ValidationError(
                f"parallel layout: ring_degree {self.ring_degree} must divide sp_degree {self.sp_degree}"
            )

    @staticmethod
    def single(device: torch.device | str | None = None) -> ParallelLayout:
        """One process doing all the work (no groups)."""
        return ParallelLayout(device=None if device is None else torch.device(device))

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    @property
    def owns_outputs(self) -> bool:
        """Rank 0 writes outputs, manifests and progress bars."""
        return self.rank == 0

    @property
    def ulysses_degree(self) -> int:
        return self.sp_degree // self.ring_degree

    @property
    def ulysses_rank(self) -> int:
        return self.sp_rank % self.ulysses_degree

    @property
    def ring_rank(self) -> int:
        return self.sp_rank // self.ulysses_degree

    @property
    def collective_device(self) -> torch.device:
        """Where this layout's collectives take their tensors: its device; a layout built from an
        already initialized world (torchrun) may not name it: the current GPU under NCCL, else the CPU."""
        if self.device is not None:
            return self.device
        if self.world_group is not None and dist.get_backend(self.world_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def groups(self) -> dict[str, Any]:
        """This rank's process groups of more than one rank, by role (world, sp, cfg, ulysses, ring);
        each group object once (with ring 1, the Ulysses group is a group of its own, as sp's)."""
        named = {
            "world": (self.world_group, self.world_size),
            "sp": (self.sp_group, self.sp_degree),
            "cfg": (self.cfg_group, self.cfg_degree),
            "ulysses": (self.ulysses_group, self.ulysses_degree),
            "ring": (self.ring_group, self.ring_degree),
        }
        found: dict[str, Any] = {}
        for name, (group, size) in named.items():
            if group is not None and size > 1 and all(group is not g for g in found.values()):
                found[name] = group
        return found

    def describe(self) -> str:
        """'sp2(ulysses2 x ring1) x cfg2': the layout in words (results, fingerprints, errors)."""
        return f"sp{self.sp_degree}(ulysses{self.ulysses_degree} x ring{self.ring_degree}) x cfg{self.cfg_degree}"

    def check_heads(self, heads: int) -> None:
        """Ulysses splits the heads over its group: the degree must divide them (else use a ring)."""
        if heads % self.ulysses_degree:
            fits = [d for d in range(1, self.sp_degree + 1) if self.sp_degree % d == 0 and heads % d == 0]
            raise ValidationError(
                f"sequence parallel: {heads} attention heads do not split over Ulysses degree "
                f"{self.ulysses_degree} (layout {self.describe()}); use a ring degree (--ring) such that "
                f"sp / ring divides {heads}: sp / ring in {fits}"
            )


def sp_ranks(config: ParallelConfig, cfg_rank: int) -> list[int]:
    """Global ranks of the sequence-parallel group of CFG branch cfg_rank."""
    return [cfg_rank * config.sp + s for s in range(config.sp)]


def init_layout(config: ParallelConfig, device: torch.device | str | None = None) -> ParallelLayout:
    """The layout of this process from an initialized torch.distributed world (one call at start-up).

    Every rank must call it in the same order: it creates the CFG, SP, Ulysses and ring groups
    (torch.distributed.new_group is collective). With world size 1 it returns the single layout.
    """
    if config.world_size == 1:
        return ParallelLayout.single(device)
    if not dist.is_initialized():
        raise ValidationError(
            "init_layout: torch.distributed is not initialized; start through mmgen.parallel.launch "
            "(mmgen generate --gpus N) or torchrun"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != config.world_size:
        raise ValidationError(
            f"parallel config asks for {config.world_size} processes (sp {config.sp}"
            f"{' x cfg 2' if config.cfg else ''}), but the world has {world}"
        )
    sp, ulysses = config.sp, config.ulysses
    cfg_degree = 2 if config.cfg else 1
    cfg_rank, sp_rank = divmod(rank, sp)
    # One communicator per set of ranks: a role whose ranks are another's (SP over the whole world,
    # Ulysses as SP with ring 1) shares that group, and a rank alone has none (None). Each NCCL
    # communicator is made and connected at the group's start (seconds of a `--gpus N` start, issue 37);
    # its collectives keep one order on every rank either way (every rank runs the same program).
    made: dict[tuple[int, ...], Any] = {tuple(range(world)): dist.group.WORLD}

    def group_of(members: list[int]) -> Any:
        key = tuple(members)
        if len(key) > 1 and key not in made:
            made[key] = dist.new_group(members)  # collective: every rank asks for every group, in order
        return made.get(key)

    groups: dict[str, Any] = {}
    for branch in range(cfg_degree):
        group = group_of(sp_ranks(config, branch))
        if branch == cfg_rank:
            groups["sp"] = group
        for ring_rank in range(config.ring):
            members = [branch * sp + ring_rank * ulysses + u for u in range(ulysses)]
            group = group_of(members)
            if rank in members:
                groups["ulysses"] = group
        for ulysses_rank in range(ulysses):
            members = [branch * sp + r * ulysses + ulysses_rank for r in range(config.ring)]
            group = group_of(members)
            if rank in members:
                groups["ring"] = group
    for position in range(sp):
        members = [branch * sp + position for branch in range(cfg_degree)]
        group = group_of(members)
        if rank in members:
            groups["cfg"] = group
    layout = ParallelLayout(
        world_size=world,
        rank=rank,
        device=None if device is None else torch.device(device),
        sp_degree=sp,
        sp_rank=sp_rank,
        sp_group=groups["sp"],
        cfg_degree=cfg_degree,
        cfg_rank=cfg_rank,
        cfg_group=groups["cfg"],
        ring_degree=config.ring,
        ring_group=groups["ring"],
        ulysses_group=groups["ulysses"],
        world_group=dist.group.WORLD,
    )
    warm_up(layout)
    return layout


# Elements per rank of warm_up's large exchange (fp32: 4 MiB): NCCL picks its protocol by message size
# and sets up each one's buffers at first use; the jobs' exchanges are megabytes.
WARM_UP_ELEMENTS = 1 << 20


def reads_for_world(layout: Any) -> bool:
    """Rank 0 computes what mmgen.parallel.share.from_first_rank shares: its loader reads the text
    encoder's weights (the other ranks' hold none: UMT5-XXL is 11.4 GB of reads and GPU memory every
    extra rank would spend on the same values; the others read the transformers instead, share.SplitReads).
    layout: a ParallelLayout or a launch.PendingLayout (its rank known before the world is joined)."""
    return layout.rank == 0


def warm_up(layout: ParallelLayout) -> dict[str, int]:
    """Every kind of collective the jobs run (broadcast, all-gather, all-to-all), small and large, once
    on each of layout's groups, and on CUDA one matmul (but on rank 0); returns {role: ranks} of the groups it ran on.
    Collective over the world.

    NCCL creates a group's communicator at the group's first collective and connects its peers at the
    first use of each algorithm and protocol: seconds on several GPUs, which the first job would pay
    (issue 38: the fixed cost per job). Done here, once per group, it is part of the group's start.
    """
    device = layout.collective_device
    warmed = {}
    for name, group in layout.groups().items():
        size = dist.get_world_size(group)
        for elements in (1, WARM_UP_ELEMENTS):
            chunk = torch.zeros(size * elements, device=device)
            dist.broadcast(chunk, src=dist.get_global_rank(group, 0), group=group)
            dist.all_gather(list(torch.empty_like(chunk).chunk(size)), chunk[:elements], group=group)
            dist.all_to_all_single(torch.empty_like(chunk), chunk, group=group)
        warmed[name] = size
    if device.type == "cuda" and not reads_for_world(layout):
        # The GEMM libraries' handles (cuBLAS, cuBLASLt) are made at a process's first matmul: ~0.1 s on
        # an H200 (RESULTS.md 24). Rank 0 makes them in its text encoder (and its world waits for its
        # join: not there); a rank that does not encode would make them in its first step while its
        # peers wait in the first exchange. Made here (a started rank's joining thread, beside its
        # load), the jobs' thread's first matmul took 4-6 ms instead of 100-130 ms (fresh processes).
        ones = torch.ones(8, 8, device=device, dtype=torch.bfloat16)
        torch.nn.functional.linear(ones, ones, ones[0])
        torch.cuda.synchronize(device)  # the set-up is done here, not queued behind the first job
    return warmed
