"""Run a model's blocks with their weights streamed from host memory, `ahead` blocks in advance.

The device holds `ahead + 1` slots, each the buffers of one block. Before block i runs, block
i + ahead is copied into the slot block i - 1 used, on a side stream that first waits for the event
recorded when block i - 1's kernels were queued (a fresh slot's first copy: the event recorded when
it was allocated); the compute stream waits for the event recorded after block i's copy. So copies
overlap compute, no host synchronization happens, and the slots are allocated once. Between blocks every block points at its host copy again.

On a CPU "device" (tests, CI) the same code runs without streams: copies are synchronous, and the
blocks compute on slot buffers that are distinct from their host storage, as on a GPU. A test can
pass its own `streams` (the three calls of CudaStreams) to check the ordering without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from mmgen.errors import ValidationError
from mmgen.placement.tensors import PinnedStore, TensorGroup


class Streams(Protocol):
    """How a BlockStream orders its copies against the blocks' kernels (events are opaque to it)."""

    def compute_event(self) -> Any:
        """An event marking what the compute stream has queued so far."""

    def compute_waits(self, event: Any) -> None:
        """Make the compute stream wait for `event` before what it queues next."""

    def copy(self, group: TensorGroup, buffers: Sequence[torch.Tensor], *, after: Any) -> Any:
        """Copy group's host bytes into `buffers` on the side stream once `after` has happened; the
        event that marks the copy done."""


class CudaStreams:
    """The compute stream (the current one at each call) and a side stream for the copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device)

    def compute_event(self) -> torch.cuda.Event:
        return torch.cuda.current_stream(self.device).record_event()

    def compute_waits(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def copy(
        self, group: TensorGroup, buffers: Sequence[torch.Tensor], *, after: torch.cuda.Event
    ) -> torch.cuda.Event:
        with torch.cuda.stream(self.side):
            self.side.wait_event(after)
            group.copy_to(buffers, non_blocking=True)
            return self.side.record_event()


class BlockStream:
    """Streams blocks of one layout (every WanBlock of one or more experts shares one set of slots).

    blocks: the modules, in the order a forward runs them (several experts may be registered with
    add(); each forward passes its own ModuleList to __call__). device: where they compute.
    `log` (when given a list) receives ("copy", block index) and ("run", block index) in order.
    streams: what orders copies and blocks (default: CudaStreams on a CUDA device, none elsewhere:
    synchronous copies).
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        ahead: int = 1,
        pin: bool,
        log: list | None = None,
        streams: Streams | None = None,
    ):
        if not isinstance(ahead, int) or isinstance(ahead, bool) or ahead < 1:
            raise ValidationError(f"BlockStream ahead = {ahead!r}: must be an integer >= 1")
        self.device = torch.device(device)
        self.ahead = ahead
        self.pin = pin
        self.log = log
        self._groups: dict[int, TensorGroup] = {}  # id(block) -> its host-backed tensors
        self._slots: list[tuple[torch.Tensor, ...]] = []  # allocated by the first forward, kept until free()
        self._views: list[tuple[torch.Tensor, ...]] = []  # each slot's tensors (one layout for all blocks)
        self._signature: tuple | None = None
        self._slot_bytes = 0
        # Per slot, the event after which it may be overwritten: its allocation, then the last block
        # that computed on it (kept across forwards: the next forward's first copies wait for the
        # previous forward's last blocks).
        self._freed: list[Any] = []
        if streams is None and self.device.type == "cuda":
            streams = CudaStreams(self.device)
        self._streams = streams

    def add(self, blocks: Sequence[nn.Module], *, adopt: PinnedStore | None = None) -> None:
        """Move `blocks` to host memory (pinned when `pin`; buffers of `adopt` they were loaded into are
        kept as they are); all blocks must share one tensor layout."""
        for block in blocks:
            group = TensorGroup(block, pin=self.pin, adopt=adopt)
            if self._signature is None:
                self._signature = group.signature
                self._slot_bytes = group.nbytes
            elif group.signature != self._signature:
                raise ValidationError(
                    f"layer offload: block {type(block).__name__} differs in its tensors from the first "
                    "streamed block; every streamed block must have the same parameter shapes and dtypes"
                )
            self._groups[id(block)] = group

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (one slot)."""
        return self._slot_bytes

    @property
    def device_bytes(self) -> int:
        """Device memory the slots hold now."""
        return self.block_bytes * len(self._slots)

    def close(self) -> None:
        """Forget the blocks and unpin their host memory (after they were moved elsewhere)."""
        self.free()
        for group in self._groups.values():
            group.close()
        self._groups.clear()

    def free(self) -> None:
        """Drop the slots (after the last forward that needs them; the next forward allocates again).

        The slots were allocated on the compute stream, so the allocator reuses their memory only
        after the kernels queued there (the last blocks) have run.
        """
        self._slots = []
        self._views = []
        self._freed = []

    def __call__(self, blocks: Sequence[nn.Module]) -> Iterator[nn.Module]:
        """Yield each block bound to device copies of its weights; rebinds it to the host after use."""
        groups = [self._groups[id(block)] for block in blocks]
        streams = self._streams
        if groups and not self._slots:
            self._slots = [groups[0].allocate(self.device) for _ in range(self.ahead + 1)]
            # Allocated on the compute stream: the caching allocator may hand out memory that kernels
            # queued there before (this forward's embeddings) still use. The side stream writes the
            # slots, so their first copies wait for this point, as every later copy waits for the
            # block that read the slot last (issue 18: NaN in the first forward after a placement).
            self._freed = [streams.compute_event() if streams is not None else None] * len(self._slots)
            # Every streamed block has the first one's signature, so its views fit every block.
            self._views = [groups[0].views(slot) for slot in self._slots]
        slots, views, freed = self._slots, self._views, self._freed
        loaded: list[Any] = [None] * len(groups)
        for index in range(min(self.ahead, len(groups))):
            self._fetch(groups, index, loaded, freed)
        waited = 0
        try:
            for index, group in enumerate(groups):
                if index + self.ahead < len(groups):
                    self._fetch(groups, index + self.ahead, loaded, freed)
                slot = index % len(slots)
                if streams is not None:
                    streams.compute_waits(loaded[index])
                waited = index + 1
                group.bind(views[slot])
                self._note("run", index)
                try:
                    yield blocks[index]
                finally:
                    if streams is not None:
                        freed[slot] = streams.compute_event()
                    group.bind_host()
        finally:
            # A forward left early (an error in a block) has copies in flight that no block waited
            # for; the compute stream waits for them, so freeing the slots (ordered on that stream)
            # cannot hand their memory out while a copy still writes it.
            for event in loaded[waited:]:
                if event is not None and streams is not None:
                    streams.compute_waits(event)

    def _fetch(self, groups: list[TensorGroup], index: int, loaded: list[Any], freed: list[Any]) -> None:
        slot = index % len(self._slots)
        self._note("copy", index)
        if self._streams is None:
            groups[index].copy_to(self._slots[slot], non_blocking=False)
            return
        loaded[index] = self._streams.copy(groups[index], self._slots[slot], after=freed[slot])

    def _note(self, what: str, index: int) -> None:
        if self.log is not None:
            self.log.append((what, index))
