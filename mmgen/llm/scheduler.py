"""Requests and the FIFO scheduler that admits them into KV memory.

A request reserves its worst case when admitted: the pages of its encoder tokens plus the pages of
max_new_tokens decoder tokens (the decoder start token and every generated token but the last).
So a running request can never run out of memory mid-decode, nothing is ever preempted, and
admission is a plain `can_allocate` check; the pages return when it finishes or is aborted.
Admission is strictly first-come first-served: a large request at the head waits for memory
rather than being overtaken forever by small ones.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from mmgen.errors import ValidationError
from mmgen.llm.memory import RequestAllocation, RequestMemory
from mmgen.llm.sampling import SamplingParams


@dataclass(eq=False)
class Request:
    """One generation request and its progress."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    step_logits: list[torch.Tensor] = field(default_factory=list)
    allocation: RequestAllocation | None = None
    finish_reason: str | None = None

    @property
    def encoder_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def decoder_capacity(self) -> int:
        return self.params.max_new_tokens

    @property
    def decoder_position(self) -> int:
        """Position (and decoder column) of the token this request feeds next step."""
        return len(self.output_ids)


class Scheduler:
    """Waiting queue and running set over one RequestMemory."""

    def __init__(self, memory: RequestMemory):
        self.memory = memory
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def check_fits(self, req: Request) -> None:
        """Raise a ValidationError when req could not run even with the engine otherwise empty."""
        columns = req.encoder_len + req.decoder_capacity
        max_context = self.memory.req_pool.max_context
        if columns > max_context:
            raise ValidationError(
                f"request {req.request_id}: prompt of {req.encoder_len} tokens + max_new_tokens="
                f"{req.decoder_capacity} = {columns} tokens exceeds the engine's max_context_len={max_context}"
            )
        pages = self.memory.pages_needed(req.encoder_len, req.decoder_capacity)
        total = self.memory.page_allocator.num_pages
        if pages > total:
            page_size = self.memory.page_size
            raise ValidationError(
                f"request {req.request_id}: needs {pages * page_size} KV slots (prompt {req.encoder_len} + "
                f"max_new_tokens {req.decoder_capacity}, each part rounded up to pages of {page_size}) but the "
                f"engine's KV budget is max_kv_tokens={total * page_size}"
            )

    def add(self, req: Request) -> None:
        self.check_fits(req)
        self.waiting.append(req)

    def admit(self) -> list[Request]:
        """Move waiting requests into memory, in order, while their worst case fits."""
        admitted = []
        while self.waiting and self.memory.can_allocate(
            self.waiting[0].encoder_len, self.waiting[0].decoder_capacity
        ):
            req = self.waiting.popleft()
            req.allocation = self.memory.allocate(req.encoder_len, req.decoder_capacity)
            self.running.append(req)
            admitted.append(req)
        return admitted

    def finish(self, req: Request, reason: str) -> None:
        """Mark req finished and return its row and pages."""
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        if req.allocation is not None:
            self.memory.free(req.allocation)
            req.allocation = None

    def find(self, request_id: str) -> Request | None:
        for req in (*self.waiting, *self.running):
            if req.request_id == request_id:
                return req
        return None

    def abort(self, request_id: str) -> Request | None:
        """Remove a waiting or running request, freeing its memory; None if it is not known (any more)."""
        req = self.find(request_id)
        if req is None:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        self.finish(req, "abort")
        return req
