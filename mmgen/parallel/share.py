"""What one rank computes or reads for its whole world, on every rank: the text encoder's output
(from_first_rank) and the weights its ranks read in parts (SplitReads, share_reads).

from_first_rank's value is a tree of tensors, tuples, lists and dataclasses with plain leaves (ints,
strings, None). Rank 0 sends the tree's shape first (the structure with each tensor's shape, dtype and
device kind: a few hundred bytes through broadcast_object_list), then each tensor through the collective
on the layout's device, so every rank gets rank 0's exact bits.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from mmgen.errors import LoadError, one_line
from mmgen.parallel.launch import PendingLayout
from mmgen.parallel.layout import ParallelLayout, reads_for_world
from mmgen.parallel.read_board import ReadBoard
from mmgen.placement.upload import Claim, Claims, Piece, Span, tensor_bytes

T = TypeVar("T")


@dataclass(frozen=True)
class _Slot:
    """Where a tensor stood in the tree: its index among the tensors sent, and how to allocate it."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_device: bool  # on the rank's collective device (a GPU under NCCL), else on the CPU


def from_first_rank(compute: Callable[[], T], layout: ParallelLayout) -> T:
    """compute() run on rank 0 only, its value on every rank of layout's world (collective: every rank
    calls it, in the same order). Rank 0 gets compute's value itself; the others a copy, its tensors on
    their collective device or on the CPU as rank 0's were. One process: compute().

    When compute raises on rank 0, every rank raises: rank 0 its error, the others a copy of it (else a
    RuntimeError with its line), so the ranks of a group fail the job at the same point, as when each
    computed for itself, and none is left waiting in the next collective (mmgen.executors.group_link)."""
    if layout.is_single:
        return compute()
    group, device, source = _world(layout)
    first = reads_for_world(layout)
    header: list[Any] = [None]
    found: list[tuple[torch.Tensor, _Slot]] = []  # rank 0's tensors, in the order of their slots
    if first:
        try:
            value = compute()
        except Exception as error:
            header[0] = ("error", _portable(error))
            dist.broadcast_object_list(header, src=source, group=group, device=device)
            raise
        skeleton = _mapped(value, lambda leaf: _slot_of(leaf, found))
        header[0] = ("value", (skeleton, [slot for _, slot in found]))
    dist.broadcast_object_list(header, src=source, group=group, device=device)
    kind, content = header[0]
    if kind == "error":
        raise content
    skeleton, slots = content
    received = []
    for slot in slots:
        if first:
            buffer = found[slot.index][0].to(device)
        else:
            buffer = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        dist.broadcast(_wire(buffer), src=source, group=group)
        if not first:
            received.append(buffer if slot.on_device else buffer.cpu())
    if first:
        return value
    return _mapped(skeleton, lambda leaf: received[leaf.index] if isinstance(leaf, _Slot) else leaf)


def _world(layout: ParallelLayout) -> tuple[Any, torch.device, int]:
    """The world group of a layout of several ranks, its collective device and its rank 0's global rank."""
    if layout.world_group is None:
        raise ValueError(f"{layout.describe()}: the layout has no world group to share over")
    return layout.world_group, layout.collective_device, dist.get_global_rank(layout.world_group, 0)


def _portable(error: Exception) -> Exception:
    """error itself where it survives pickling (what broadcast_object_list does), else a RuntimeError
    with its line."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any error that does not pickle is sent as its line
        return RuntimeError(f"rank 0: {one_line(error, typed=True)}")
    return error


def _slot_of(leaf: Any, found: list[tuple[torch.Tensor, _Slot]]) -> Any:
    """A tensor's _Slot (the pair appended to `found`); any other leaf as it is."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    slot = _Slot(len(found), tuple(leaf.shape), leaf.dtype, leaf.device.type != "cpu")
    found.append((leaf, slot))
    return slot


def _mapped(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """value's tree (tuples, lists, dataclasses other than _Slot) rebuilt with leaf(x) for every other
    node, depth first in order (a dataclass's fields passed to its constructor: the dataclasses shared
    here have init fields only)."""
    if type(value) in (tuple, list):
        return type(value)(_mapped(item, leaf) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type | _Slot):
        fields = dataclasses.fields(value)
        return type(value)(**{f.name: _mapped(getattr(value, f.name), leaf) for f in fields})
    return leaf(value)


def shares_weights(layout: Any, on_host: bool) -> bool:
    """Whether the ranks split their reads (SplitReads) and share_reads completes them: several ranks
    and the weights going to the device (offloaded weights are each rank's own host copies). layout: a
    ParallelLayout or a launch.PendingLayout (world_size known before the world is joined)."""
    return layout.world_size > 1 and not on_host


def split_reads(layout: Any, on_host: bool, read_bytes: Callable[[], Mapping[str, int]]) -> SplitReads | None:
    """A loader's SplitReads, or None where each rank reads all it keeps (one process, or the weights on
    the host: shares_weights). read_bytes: {part name: its checkpoint's bytes} in the order read (a
    family's, e.g. wan_read_bytes), called only for a split; "text_encoder" is rank 0's alone."""
    if not shares_weights(layout, on_host):
        return None
    parts = [ReadPart(name, size, everyone=name != "text_encoder") for name, size in read_bytes().items()]
    return SplitReads.over(layout, parts)


@dataclass(frozen=True)
class ReadPart:
    """A module whose checkpoint a world's ranks read in parts: its name (the loader's, e.g.
    "transformer"), its checkpoint's bytes (from its headers, so every rank counts alike before anything
    is built), and whether every rank keeps it (a transformer) or rank 0 alone (the text encoder: rank 0
    encodes for the world, reads_for_world)."""

    name: str
    bytes: int
    everyone: bool = True


class SplitReads:
    """A world's host reads split over its ranks: each piece of each part (mmgen.placement.upload.
    read_pieces: up to 256 MB of consecutive tensors, the same list on every rank) read by one rank,
    onto its own GPU over its own host link, all at once; share_reads then completes every module where
    it is kept (a transformer's pieces broadcast from their readers to every rank, the text encoder's
    sent to rank 0) and every rank learns who read what.

    Who reads which piece: with a ReadBoard (the ranks `mmgen generate --gpus N` starts), whoever takes
    it first: each rank's reading threads take the next piece as they finish one, so the ranks end
    together however late each began. Without one, a fixed split: the parts' bytes laid end to end,
    rank 0 reads the first `first` bytes (an equal share when the text encoder is a part, placed first
    so that rank 0 reads as much of it as it can itself; else none: it reads an encoder whose loader
    reads it whole), ranks 1 ... N - 1 equal runs of the rest, each piece read by the rank whose run
    holds its middle. Measured: benchmarks/RESULTS.md 28, 29.

    Made per load (`over`); a loader's claims (`reads()`) note the pieces and what this rank took."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        parts: Sequence[ReadPart],
        first: int,
        board: ReadBoard | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.parts = tuple(parts)
        self.first = first
        self.board = board
        self.pieces: dict[str, list[Piece]] = {}  # per part, once its loader listed them
        self.taken: dict[str, list[int]] = {part.name: [] for part in parts}  # the pieces this rank read

    @classmethod
    def over(cls, layout: Any, parts: Sequence[ReadPart]) -> SplitReads:
        """The split of `parts` for this rank of layout's world (a ParallelLayout, or a PendingLayout
        with its world's board)."""
        total = sum(part.bytes for part in parts)
        encoder_in = any(not part.everyone for part in parts)
        first = -(-total // layout.world_size) if encoder_in else 0
        board = layout.board if isinstance(layout, PendingLayout) else None
        return cls(layout.rank, layout.world_size, parts, first, board)

    def reads(self) -> dict[str, Claims]:
        """{part name: the claims of its load (load_into_module's `read`)}."""
        return {part.name: partial(self._claims, part.name) for part in self.parts}

    def _claims(self, name: str, pieces: list[Piece], sizes: list[int]) -> Claim:
        """Part `name`'s claim function for its loader's pieces (of `sizes` bytes), noting what it gives."""
        self.pieces[name] = pieces
        taken, lock = self.taken[name], threading.Lock()
        if self.board is not None:
            slot = [part.name for part in self.parts].index(name)

            def from_board() -> int | None:
                index = self.board.take(slot, len(pieces))
                if index is not None:
                    with lock:
                        taken.append(index)
                return index

            return from_board
        mine = iter([i for i, reader in enumerate(self.fixed_readers(name, sizes)) if reader == self.rank])

        def fixed() -> int | None:
            with lock:
                index = next(mine, None)
                if index is not None:
                    taken.append(index)
                return index

        return fixed

    def fixed_readers(self, name: str, sizes: list[int]) -> list[int]:
        """The fixed split's reader of each piece of part `name` (pieces of `sizes` bytes)."""
        if self.world_size == 1:
            return [0] * len(sizes)
        index = [part.name for part in self.parts].index(name)
        before = sum(part.bytes for part in self.parts[:index])
        total, others = sum(part.bytes for part in self.parts), self.world_size - 1
        rest = max(1, total - self.first)
        readers = []
        for size in sizes:
            middle = 2 * before + size  # twice the middle's position: integers, every rank computes alike
            if middle < 2 * self.first:
                readers.append(0)
            else:
                readers.append(1 + min(others - 1, (middle - 2 * self.first) * others // (2 * rest)))
            before += size
        return readers


def share_reads(split: SplitReads, modules: Mapping[str, nn.Module], layout: ParallelLayout) -> None:
    """Every part of `split` completed where it is kept, once each rank read its pieces
    (load_into_module(read=split.reads()[name]) on every rank, the rest allocated where the module is
    kept and left on the meta device where not): a part every rank keeps gets each piece broadcast from
    its reader; the part rank 0 alone keeps gets each piece another rank read sent to it, and is dropped
    to the meta device on the others. Collective; modules: {part name: module}.

    One copy of the checkpoint is read from the host instead of one per rank (or all of it by rank 0),
    and the rest crosses between the GPUs (NVLink under NCCL). First the parts' listings (names, shapes,
    dtypes) are compared: a difference is every rank's LoadError, naming the module and its first
    differing tensor, before any tensor moves; then who read which piece: a piece read by no rank or by
    two (a board used twice) is every rank's LoadError."""
    group, _, _ = _world(layout)
    _check_listings(
        {part.name: _distinct_tensors(modules[part.name]) for part in split.parts}, modules, layout
    )
    readers = _readers(split, layout)
    for part in split.parts:
        state = modules[part.name].state_dict(keep_vars=True)
        pieces = list(zip(split.pieces[part.name], readers[part.name], strict=True))
        if part.everyone:
            for piece, reader in pieces:
                _broadcast_piece([_span(state, span) for span in piece], reader, layout)
            continue
        sends = [
            dist.P2POp(dist.irecv, _span(state, span), group=group, group_peer=reader)
            if layout.rank == 0
            else dist.P2POp(dist.isend, _span(state, span), group=group, group_peer=0)
            for piece, reader in pieces
            if reader != 0 and layout.rank in (0, reader)
            for span in piece
        ]
        if sends:  # one NCCL group of point-to-point calls on the world's communicator
            for work in dist.batch_isend_irecv(sends):
                work.wait()
        if layout.rank != 0:
            modules[part.name].to("meta")  # its pieces are rank 0's now


def _readers(split: SplitReads, layout: ParallelLayout) -> dict[str, list[int]]:
    """{part: the rank that read each of its pieces}, from every rank's SplitReads.taken (collective)."""
    group, _, _ = _world(layout)
    every: list[Any] = [None] * layout.world_size
    dist.all_gather_object(every, split.taken, group=group)
    readers = {}
    for part in split.parts:
        if part.name not in split.pieces:  # (every rank alike: the same loader code)
            raise LoadError(f"{part.name}: its loader took no pieces (it was not given the split's reads)")
        count = len(split.pieces[part.name])
        found: list[list[int]] = [[] for _ in range(count)]
        for rank, taken in enumerate(every):
            for index in taken[part.name]:
                found[index].append(rank)
        wrong = next((i for i, ranks in enumerate(found) if len(ranks) != 1), None)
        if wrong is not None:
            raise LoadError(
                f"{part.name}: piece {wrong} of {count} was read by {len(found[wrong])} ranks "
                f"({found[wrong]}), not one: every piece of a split load is read once"
            )
        readers[part.name] = [ranks[0] for ranks in found]
    return readers


def _span(state: Mapping[str, torch.Tensor], span: Span) -> torch.Tensor:
    """A piece's span of the module's tensor as the collectives send it (uint8: any dtype, bool too): its
    bytes [start, end), or all of them (end -1: a tensor cast where it was read)."""
    name, start, end = span
    data = tensor_bytes(state[name].detach())
    return data if end < 0 else data[start:end]


def _broadcast_piece(spans: list[torch.Tensor], reader: int, layout: ParallelLayout) -> None:
    """A piece's spans (views of the modules' tensors) broadcast from `reader`: one collective, its spans
    packed into one buffer when several (the small tensors a piece groups: a broadcast each was ~1,000
    calls for a Wan2.1-1.3B DiT)."""
    group, _, _ = _world(layout)
    source = dist.get_global_rank(group, reader)
    if len(spans) == 1:
        dist.broadcast(spans[0], src=source, group=group)
        return
    if layout.rank == reader:
        dist.broadcast(torch.cat(spans), src=source, group=group)
        return
    packed = torch.empty(sum(span.numel() for span in spans), dtype=torch.uint8, device=spans[0].device)
    dist.broadcast(packed, src=source, group=group)
    start = 0
    for span in spans:
        span.copy_(packed[start : start + span.numel()])
        start += span.numel()


def _check_listings(
    tensors: Mapping[str, list[tuple[str, torch.Tensor]]],
    modules: Mapping[str, nn.Module],
    layout: ParallelLayout,
) -> None:
    """Every rank's LoadError unless the parts' listings (names, shapes, dtypes) equal rank 0's (collective)."""
    group, device, source = _world(layout)
    listing = {name: [(key, tuple(t.shape), t.dtype) for key, t in found] for name, found in tensors.items()}
    header: list[Any] = [listing if reads_for_world(layout) else None]
    dist.broadcast_object_list(header, src=source, group=group, device=device)
    same = torch.tensor([int(header[0] == listing)], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN, group=group)
    if same.item():
        return
    differing = next((name for name, mine in listing.items() if header[0].get(name) != mine), None)
    name = differing or next(iter(listing))  # (the same here: another rank differs from rank 0)
    mine, theirs = listing[name], header[0].get(name, [])
    first = next((m for m, t in zip(mine, theirs, strict=False) if m != t), None)
    here = "the same here" if differing is None else f"first difference here: {first}"
    raise LoadError(
        f"{type(modules[name]).__name__}: the ranks' modules differ ({len(mine)} tensors here, "
        f"{len(theirs)} on rank 0; {here}): every rank must load the same model"
    )


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """tensor as the collectives send it: bool as its bytes (uint8, the same itemsize; not every backend
    takes bool)."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


def _distinct_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's state-dict tensors (parameters, persistent buffers) in its order, a tied tensor once."""
    seen: set[int] = set()
    found = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            found.append((name, tensor.detach()))
    return found
