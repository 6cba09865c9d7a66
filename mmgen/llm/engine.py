"""The generation engine: continuous batching of encoder-decoder requests over a paged KV cache.

Each `step()` admits waiting requests whose worst case fits the KV budget (scheduler.py), runs the
encoder for them, then one decoder forward for every running request (model_runner.py), samples one
token per request with its own parameters and generator, and retires those that hit a stop token
or max_new_tokens, freeing their memory. Requests added between steps join the next one, so new
requests start while others are mid-decode. The engine owns its pools and backend; nothing global.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from mmgen.errors import MmgenError, ValidationError
from mmgen.llm.backends import BACKEND_NAMES, make_backend
from mmgen.llm.cuda_graph_runner import CudaGraphRunner
from mmgen.llm.memory import KVPool, PageAllocator, ReqToTokenPool, RequestMemory
from mmgen.llm.model_runner import ModelRunner
from mmgen.llm.models.t5gemma import T5GemmaForConditionalGeneration
from mmgen.llm.models.t5gemma_loading import load_t5gemma
from mmgen.llm.sampling import SamplingParams, choose_tokens
from mmgen.llm.scheduler import Request, Scheduler


@dataclass(frozen=True)
class EngineConfig:
    """Memory and batching limits.

    max_kv_tokens: KV slots in the pool (a multiple of page_size); a request reserves its prompt plus
    max_new_tokens slots, each part rounded up to whole pages. max_running_requests: req_to_token
    rows. max_context_len: columns per row (prompt + max_new_tokens). cuda_graph_batch_sizes: DECODE
    steps of up to max(...) requests replay a decode step captured per size (mmgen.llm.cuda_graph_runner;
    a graph-capable backend: flash_attention or flashinfer); () = every step eager.
    """

    max_kv_tokens: int = 16384
    page_size: int = 16
    max_running_requests: int = 32
    max_context_len: int = 4096
    backend: str = "torch_native"
    cuda_graph_batch_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_kv_tokens", "page_size", "max_running_requests", "max_context_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValidationError(f"EngineConfig.{name} = {value!r}, must be an integer >= 1")
        if self.max_kv_tokens % self.page_size:
            raise ValidationError(
                f"EngineConfig.max_kv_tokens = {self.max_kv_tokens} is not a multiple of page_size = {self.page_size}"
            )
        if self.backend not in BACKEND_NAMES:
            raise ValidationError(
                f"EngineConfig.backend = {self.backend!r}; choose one of {', '.join(BACKEND_NAMES)}"
            )
        if self.cuda_graph_batch_sizes and self.backend == "torch_native":
            raise ValidationError(
                "EngineConfig.cuda_graph_batch_sizes needs backend flash_attention or flashinfer, not torch_native"
            )


@dataclass
class GenerationOutput:
    """A finished request. finish_reason: "stop" (a stop token, kept as the last id), "length",
    "abort", or "error" (the request was refused; `error` says why). logits: fp32 [steps, vocab]
    when the request asked for them."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    error: str | None = None
    logits: torch.Tensor | None = None


class Engine:
    """Batched generation with a T5Gemma model: add_request/step/abort, or generate() for a list."""

    def __init__(
        self,
        model: T5GemmaForConditionalGeneration,
        config: EngineConfig | None = None,
        tokenizer=None,
        backend_options: dict | None = None,
    ):
        """backend_options: keywords for the backend (see mmgen.llm.backends.make_backend)."""
        self.model = model
        self.config = config or EngineConfig()
        self.tokenizer = tokenizer
        param = next(model.parameters())
        self.device = param.device
        dec = model.config.decoder
        num_pages = self.config.max_kv_tokens // self.config.page_size
        self.req_pool = ReqToTokenPool(
            self.config.max_running_requests, self.config.max_context_len, self.device
        )
        self.page_allocator = PageAllocator(num_pages, self.config.page_size)
        self.kv_pool = KVPool(
            dec.num_hidden_layers,
            num_pages,
            self.config.page_size,
            dec.num_key_value_heads,
            dec.head_dim,
            param.dtype,
            self.device,
        )
        self.backend = make_backend(
            self.config.backend,
            self.req_pool,
            self.kv_pool,
            layers=model.decoder_attention_layers(),
            **(backend_options or {}),
        )
        self.scheduler = Scheduler(RequestMemory(self.req_pool, self.page_allocator))
        graph_runner = None
        if self.config.cuda_graph_batch_sizes:
            graph_runner = CudaGraphRunner(model, self.backend, self.config.cuda_graph_batch_sizes)
            graph_runner.capture()
        self.runner = ModelRunner(model, self.req_pool, self.backend, graph_runner)
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        config: EngineConfig | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> Engine:
        """Load an HF-format T5Gemma directory (weights, config, tokenizer.json) into an engine."""
        loaded = load_t5gemma(directory, dtype=dtype, device=device)
        return cls(loaded.model, config, loaded.tokenizer)

    # -- requests ---------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValidationError(
                    "a text prompt needs a tokenizer; pass token ids or load tokenizer.json"
                )
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        vocab = self.model.config.encoder.vocab_size
        if not ids:
            raise ValidationError("prompt is empty: it must have at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValidationError(f"prompt token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        return ids

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; raises a ValidationError when it could never fit the engine's limits."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if self.scheduler.find(request_id) is not None:
            raise ValidationError(f"request id {request_id!r} is already in use")
        stop = params.stop_token_ids if params.stop_token_ids is not None else self.model.config.eos_token_ids
        req = Request(
            request_id=request_id,
            prompt_ids=self._prompt_ids(prompt),
            params=params,
            stop_ids=frozenset(stop),
            generator=params.make_generator(self.device),
        )
        self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str) -> GenerationOutput | None:
        """Stop a waiting or running request now and free its slots; None if it is unknown or finished."""
        req = self.scheduler.abort(request_id)
        return None if req is None else self._output(req)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # -- stepping ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[GenerationOutput]:
        """Admit, encode newcomers, decode one token for every running request; -> requests finished now."""
        newcomers = self.scheduler.admit()
        if newcomers:
            self.runner.encode(newcomers)
        running = list(self.scheduler.running)
        if not running:
            if self.scheduler.waiting:
                raise MmgenError("no request is running and the head of the queue does not fit the KV budget")
            return []
        logits = self.runner.decode(running, self.model.config.decoder_start_token_id)
        tokens = choose_tokens(logits, [r.params for r in running], [r.generator for r in running])
        finished = []
        for i, (req, token) in enumerate(zip(running, tokens, strict=True)):
            req.output_ids.append(token)
            if req.params.return_logits:
                req.step_logits.append(logits[i].detach().cpu())
            reason = None
            if token in req.stop_ids:
                reason = "stop"
            elif len(req.output_ids) >= req.params.max_new_tokens:
                reason = "length"
            if reason is not None:
                self.scheduler.finish(req, reason)
                finished.append(self._output(req))
        return finished

    def _output(self, req: Request, error: str | None = None) -> GenerationOutput:
        text = None
        if self.tokenizer is not None:
            ids = req.output_ids[:-1] if req.finish_reason == "stop" else req.output_ids
            text = self.tokenizer.decode(ids)
        return GenerationOutput(
            request_id=req.request_id,
            prompt_ids=list(req.prompt_ids),
            token_ids=list(req.output_ids),
            text=text,
            finish_reason=req.finish_reason or "error",
            error=error,
            logits=torch.stack(req.step_logits) if req.step_logits else None,
        )

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Run every prompt to completion (continuous batching) -> outputs in prompt order.

        A prompt that can never fit the engine's limits gets finish_reason "error" and the reason in
        `error`; the others still run.
        """
        if isinstance(prompts, str):
            raise ValidationError("generate() takes a list of prompts; wrap a single prompt in a list")
        if self.has_unfinished():
            raise ValidationError(
                "generate() needs an idle engine; requests added with add_request are unfinished"
            )
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValidationError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
            per_prompt = params
        else:
            per_prompt = [params or SamplingParams()] * len(prompts)
        outputs: dict[str, GenerationOutput] = {}
        order = []
        for prompt, p in zip(prompts, per_prompt, strict=True):
            request_id = f"req-{next(self._ids)}"
            order.append(request_id)
            try:
                self.add_request(prompt, p, request_id)
            except MmgenError as err:
                outputs[request_id] = GenerationOutput(
                    request_id=request_id,
                    prompt_ids=list(prompt) if not isinstance(prompt, str) else [],
                    token_ids=[],
                    text=None,
                    finish_reason="error",
                    error=str(err),
                )
        wanted = set(order) - set(outputs)
        while wanted:
            for out in self.step():
                if out.request_id in wanted:
                    outputs[out.request_id] = out
                    wanted.discard(out.request_id)
        return [outputs[rid] for rid in order]

    # -- memory accounting (tests, monitoring) -----------------------------------------------------

    def num_free_pages(self) -> int:
        return self.page_allocator.num_free()

    def num_free_rows(self) -> int:
        return self.req_pool.num_free()
