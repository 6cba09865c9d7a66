"""The placement of a pipeline's weights under one offload mode, and the denoise loop's Placement.

- none: every component stays where it was loaded (on the compute device);
- model: text encoder, VAE and each DiT expert live in (pinned) host memory and are copied onto the
  device only while they run; one component at a time. With Wan2.2's two experts the idle one stays
  on the host, and (when the plan allows two on the device) the next expert is copied in on a side
  stream during the last step of the current one, so the switch waits for nothing;
- layer: the DiT blocks of every expert stream from host memory (BlockStream, one block ahead, one
  set of slots shared by all experts); the rest of each expert (embeddings, head: ~1% of it) stays
  on the device; text encoder and VAE as under model.

`log` records every move as (action, component) so tests can check the order of loads and parks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from mmgen.placement.policy import OFFLOAD_MODES, check_offload
from mmgen.placement.stream import BlockStream
from mmgen.placement.tensors import PinnedStore, TensorGroup, pin_available


class OffloadPlacement:
    """Weights of experts ('expert0', 'expert1', ...), 'text_encoder' and 'vae' placed for `offload`.

    experts: the DiT modules (each with .blocks); device: where they compute. Under layer offload,
    `stream` (the DiT blocks') and `text_stream` (the text encoder's layers) are what the caller
    passes to each model call (ExecutionSettings.block_stream; UMT5Encoder(block_stream=)): the
    placement writes nothing onto the modules. text_encoder None: the rank holds none (it receives
    its text from the rank that encodes, mmgen.parallel.share.reads_for_world).
    pin: page-locked host copies (default: when CUDA is available). Construction moves the weights.
    host: the PinnedStore the weights were loaded into (from_pretrained with offload): offloaded
    tensors keep those buffers as their host copies, nothing is copied; the store is closed here
    (buffers of weights that went to the device are unpinned and go with their tensors).
    """

    def __init__(
        self,
        offload: str,
        *,
        experts: Sequence[nn.Module],
        text_encoder: nn.Module | None,
        vae: nn.Module,
        device: torch.device | str,
        prefetch_experts: bool = False,
        pin: bool | None = None,
        host: PinnedStore | None = None,
    ) -> None:
        try:
            self._place(offload, experts, text_encoder, vae, device, prefetch_experts, pin, host)
        finally:
            if host is not None:
                host.close()

    def _place(
        self,
        offload: str,
        experts: Sequence[nn.Module],
        text_encoder: nn.Module | None,
        vae: nn.Module,
        device: torch.device | str,
        prefetch_experts: bool,
        pin: bool | None,
        host: PinnedStore | None,
    ) -> None:
        self.offload = check_offload(offload)
        self.device = torch.device(device)
        self.prefetch_experts = prefetch_experts
        self.log: list[tuple[str, str]] = []
        pin = pin_available() and self.device.type == "cuda" if pin is None else pin
        self._modules: dict[str, nn.Module] = {f"expert{i}": e for i, e in enumerate(experts)}
        if text_encoder is not None:
            self._modules["text_encoder"] = text_encoder
        self._modules["vae"] = vae
        self._groups: dict[str, TensorGroup] = {}
        self._loaded: dict[str, tuple[torch.Tensor, ...]] = {}
        self._ready: dict[str, torch.cuda.Event] = {}
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.stream: BlockStream | None = None
        self.text_stream: BlockStream | None = None
        if self.offload == "none":
            for module in self._modules.values():
                module.to(self.device)
            return
        offloaded = ["vae"]
        if self.offload == "model":
            offloaded += [name for name in self._modules if name != "vae"]  # experts, text encoder
        else:
            self.stream = BlockStream(self.device, pin=pin)
            for expert in experts:
                self.stream.add(expert.blocks, adopt=host)
                _move_except(expert, expert.blocks, self.device)
            # The text encoder's layers (a UMT5Encoder's encoder.block) stream too, once per request:
            # as cheap as copying it whole; its embedding table and final norm are copied in while
            # it runs. An encoder without such a stack moves whole, as under model.
            stack = getattr(text_encoder, "encoder", None)
            if isinstance(getattr(stack, "block", None), nn.ModuleList):
                self.text_stream = BlockStream(self.device, pin=pin)
                self.text_stream.add(stack.block, adopt=host)
                self._groups["text_encoder"] = TensorGroup(
                    text_encoder, pin=pin, skip=stack.block, adopt=host
                )
            elif text_encoder is not None:
                offloaded.append("text_encoder")
        for name in offloaded:
            self._groups[name] = TensorGroup(self._modules[name], pin=pin, adopt=host)

    @property
    def resident(self) -> tuple[str, ...]:
        """The offloaded components now on the device (model / layer modes)."""
        return tuple(self._loaded)

    def before_step(self, step: Any, next_step: Any | None) -> None:
        """Make step.expert's weights ready; prefetch next_step's expert when it differs and the plan allows."""
        if self.offload != "model":
            return
        name = f"expert{step.expert}"
        self._require(name)
        if self.prefetch_experts and next_step is not None and next_step.expert != step.expert:
            self._load(f"expert{next_step.expert}", prefetch=True)

    @contextmanager
    def using(self, name: str) -> Iterator[nn.Module]:
        """`name` ('text_encoder' or 'vae') on the device while the block runs; parked after (model, layer)."""
        module = self._modules[name]
        if name not in self._groups:
            yield module
            return
        self._require(name)
        try:
            yield module
        finally:
            self._park(name)
            if name == "text_encoder" and self.text_stream is not None:
                self.text_stream.free()

    def park_all(self) -> None:
        """Every offloaded component back to the host (after the last step), and the DiT's stream slots
        dropped: kept, they would sit through the decode and the next request's text encoding (two 14B
        blocks: 1.3 GiB above those stages' estimates, measured on an H100, RESULTS.md 9c)."""
        for name in list(self._loaded):
            self._park(name)
        if self.stream is not None:
            self.stream.free()

    def release(self, to: torch.device | None = None) -> None:
        """Undo this placement: every weight a plain tensor on `to` (default: the device) again."""
        target = self.device if to is None else torch.device(to)
        self.park_all()
        for name, module in self._modules.items():
            if name in self._groups or self.stream is not None:
                module.to(target)
        for group in self._groups.values():
            group.close()
        for stream in (self.stream, self.text_stream):
            if stream is not None:
                stream.close()
        self._groups.clear()
        self.stream = self.text_stream = None
        self.log.append(("release", self.offload))

    def _require(self, name: str) -> None:
        """`name` on the device, everything else offloaded parked first (one component at a time)."""
        for other in list(self._loaded):
            if other != name:
                self._park(other)
        if name not in self._loaded:
            self._load(name, prefetch=False)
        ready = self._ready.pop(name, None)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
            self.log.append(("wait", name))

    def _load(self, name: str, *, prefetch: bool) -> None:
        if name in self._loaded:
            return
        group = self._groups[name]
        buffers = group.allocate(self.device)  # on the compute stream: freeing it later is ordered there
        if prefetch and self._copy_stream is not None:
            allocated = torch.cuda.current_stream(self.device).record_event()
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(allocated)
                group.copy_to(buffers, non_blocking=True)
                self._ready[name] = self._copy_stream.record_event()
        else:
            group.copy_to(buffers, non_blocking=self._copy_stream is not None)
        group.bind(group.views(buffers))
        self._loaded[name] = buffers
        self.log.append(("prefetch" if prefetch else "load", name))

    def _park(self, name: str) -> None:
        ready = self._ready.pop(name, None)
        if ready is not None:
            # A prefetch never waited for: its buffers are freed on the compute stream, so that
            # stream must not run ahead of the copy still writing them.
            torch.cuda.current_stream(self.device).wait_event(ready)
        self._groups[name].bind_host()
        del self._loaded[name]
        self.log.append(("park", name))


def _move_except(module: nn.Module, skip: nn.Module, device: torch.device) -> None:
    """Move module's own tensors and every child but `skip` to `device` (the blocks stay streamed)."""
    for child in module.children():
        if child is not skip:
            child.to(device)
    for table in (module._parameters, module._buffers):
        for tensor in table.values():
            if tensor is not None:
                tensor.data = tensor.data.to(device)


__all__ = ("OFFLOAD_MODES", "OffloadPlacement")
