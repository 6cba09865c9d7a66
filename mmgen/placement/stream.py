"""Run a model's blocks with their weights streamed from host memory, `ahead` blocks in advance.

The device holds `ahead + 1` slots, each the buffers of one block. Before block i runs, block
i + ahead is copied into the slot block i - 1 used, on a side stream that first waits for the event
recorded when block i - 1's kernels were queued; the compute stream waits for the event recorded
after block i's copy. So copies overlap compute, no host synchronization happens, and the slots are
allocated once. Between blocks every block points at its host copy again.

On a CPU "device" (tests, CI) the same code runs without streams: copies are synchronous, and the
blocks compute on slot buffers that are distinct from their host storage, as on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from mmgen.errors import ValidationError
from mmgen.placement.tensors import PinnedStore, TensorGroup


class BlockStream:
    """Streams blocks of one layout (every WanBlock of one or more experts shares one set of slots).

    blocks: the modules, in the order a forward runs them (several experts may be registered with
    add(); each forward passes its own ModuleList to __call__). device: where they compute.
    `log` (when given a list) receives ("copy", block index) and ("run", block index) in order.
    """

    def __init__(self, device: torch.device | str, *, ahead: int = 1, pin: bool, log: list | None = None):
        if not isinstance(ahead, int) or isinstance(ahead, bool) or ahead < 1:
            raise ValidationError(f"BlockStream ahead = {ahead!r}: must be an integer >= 1")
        self.device = torch.device(device)
        self.ahead = ahead
        self.pin = pin
        self.log = log
        self._groups: dict[int, TensorGroup] = {}  # id(block) -> its host-backed tensors
        self._slots: list[tuple[torch.Tensor, ...]] = []  # allocated by the first forward, kept until free()
        self._signature: tuple | None = None
        self._slot_bytes = 0
        # Per slot, the event recorded after the last block that computed on it: kept across
        # forwards, so the next forward's first copies wait for the previous forward's last blocks.
        self._freed: list[torch.cuda.Event | None] = []
        cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None

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
        self._freed = []

    def __call__(self, blocks: Sequence[nn.Module]) -> Iterator[nn.Module]:
        """Yield each block bound to device copies of its weights; rebinds it to the host after use."""
        groups = [self._groups[id(block)] for block in blocks]
        if groups and not self._slots:
            self._slots = [groups[0].allocate(self.device) for _ in range(self.ahead + 1)]
            self._freed = [None] * len(self._slots)
        slots, freed = self._slots, self._freed
        views = [groups[0].views(slot) for slot in slots] if groups else []
        loaded: list[torch.cuda.Event | None] = [None] * len(groups)
        for index in range(min(self.ahead, len(groups))):
            self._fetch(groups, index, loaded, freed)
        for index, block in enumerate(groups):
            if index + self.ahead < len(groups):
                self._fetch(groups, index + self.ahead, loaded, freed)
            slot = index % len(slots)
            if loaded[index] is not None:
                torch.cuda.current_stream(self.device).wait_event(loaded[index])
            block.bind(views[slot])
            self._note("run", index)
            try:
                yield blocks[index]
            finally:
                if self._copy_stream is not None:
                    freed[slot] = torch.cuda.current_stream(self.device).record_event()
                block.bind_host()

    def _fetch(
        self,
        groups: list[TensorGroup],
        index: int,
        loaded: list[torch.cuda.Event | None],
        freed: list[torch.cuda.Event | None],
    ) -> None:
        slot = index % len(self._slots)
        self._note("copy", index)
        if self._copy_stream is None:
            groups[index].copy_to(self._slots[slot], non_blocking=False)
            return
        with torch.cuda.stream(self._copy_stream):
            if freed[slot] is not None:
                self._copy_stream.wait_event(freed[slot])
            groups[index].copy_to(self._slots[slot], non_blocking=True)
            loaded[index] = self._copy_stream.record_event()

    def _note(self, what: str, index: int) -> None:
        if self.log is not None:
            self.log.append((what, index))
