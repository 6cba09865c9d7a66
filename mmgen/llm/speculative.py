"""Greedy speculative decoding with a draft model (a smaller encoder-decoder with the same tokenizer).

Per round, for every running request with m committed decoder tokens (the start token and the
outputs so far; the last one, "pending", is in the draft's KV but not yet in the target's):
1. the draft proposes k tokens: d1 came out of the previous round, d2..dk from k - 1 DECODE steps;
2. the target scores [pending, d1..dk] in one TARGET_VERIFY step (k + 1 tokens, causal) and accepts
   the longest prefix d1..dn on which its own argmax agrees, plus its own next token (the bonus);
3. the draft catches up in one DRAFT_EXTEND_V2 step over the committed tokens it has no valid KV
   for (the bonus, and dk when all k were accepted): seq_lens = its valid prefix, extend_seq_lens =
   1 or 2 per request, so each request reads seq_lens + extend_seq_lens keys. Its last output is
   the next round's d1.
Rejected tokens' KV needs no freeing: their slots are overwritten when those positions are reached.
The target only ever emits its own argmax, so the output equals plain greedy decoding of the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmgen.errors import ValidationError
from mmgen.llm.backends import make_backend
from mmgen.llm.forward_batch import ForwardBatch, ForwardMode, SpecInfo
from mmgen.llm.memory import KVPool, PageAllocator, ReqToTokenPool, RequestAllocation, RequestMemory


def build_batch(
    mode: ForwardMode,
    req_to_token: torch.Tensor,
    rows: Sequence[int],
    encoder_lens: Sequence[int],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    draft_token_num: int | None = None,
) -> ForwardBatch:
    """A ForwardBatch where request i writes extend_lens[i] decoder tokens after prefix_lens[i] cached ones.

    seq_lens follows the convention of forward_batch.py: prefix + extend, except DRAFT_EXTEND_V2 (prefix).
    """
    device = req_to_token.device
    if mode is ForwardMode.DECODE and any(n != 1 for n in extend_lens):
        raise ValidationError(f"a DECODE batch has one token per request, got {list(extend_lens)}")
    cols = [
        e + p + j for e, p, n in zip(encoder_lens, prefix_lens, extend_lens, strict=True) for j in range(n)
    ]
    row_of_token = [r for r, n in zip(rows, extend_lens, strict=True) for _ in range(n)]
    positions = [p + j for p, n in zip(prefix_lens, extend_lens, strict=True) for j in range(n)]
    out_cache_loc = req_to_token[
        torch.tensor(row_of_token, dtype=torch.int64, device=device),
        torch.tensor(cols, dtype=torch.int64, device=device),
    ].long()
    pre = torch.tensor(prefix_lens, dtype=torch.int32)
    ext = torch.tensor(extend_lens, dtype=torch.int32)
    seq = pre if mode is ForwardMode.DRAFT_EXTEND_V2 else pre + ext
    enc = torch.tensor(encoder_lens, dtype=torch.int32)
    extend_like = mode is not ForwardMode.DECODE
    spec = SpecInfo(draft_token_num) if draft_token_num is not None else None
    return ForwardBatch(
        forward_mode=mode,
        batch_size=len(rows),
        req_pool_indices=torch.tensor(list(rows), dtype=torch.int64, device=device),
        seq_lens=seq.to(device),
        seq_lens_cpu=seq,
        out_cache_loc=out_cache_loc,
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        extend_seq_lens=ext.to(device) if extend_like else None,
        extend_seq_lens_cpu=ext if extend_like else None,
        extend_prefix_lens=pre.to(device) if extend_like else None,
        extend_prefix_lens_cpu=pre if extend_like else None,
        encoder_lens=enc.to(device),
        encoder_lens_cpu=enc,
        spec_info=spec,
    )


class ModelSession:
    """One encoder-decoder model with its own paged KV memory and backend; runs steps of any mode."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        backend: str = "torch_native",
        page_size: int = 16,
        max_requests: int = 16,
        max_context: int = 1024,
        max_kv_tokens: int = 16384,
        backend_options: dict | None = None,
    ) -> None:
        param = next(model.parameters())
        dec = model.config.decoder
        num_pages = max_kv_tokens // page_size
        self.model = model
        self.device = param.device
        self.req_pool = ReqToTokenPool(max_requests, max_context, self.device)
        self.memory = RequestMemory(self.req_pool, PageAllocator(num_pages, page_size))
        self.kv_pool = KVPool(
            dec.num_hidden_layers,
            num_pages,
            page_size,
            dec.num_key_value_heads,
            dec.head_dim,
            param.dtype,
            self.device,
        )
        self.backend = make_backend(
            backend, self.req_pool, self.kv_pool, model.decoder_attention_layers(), **(backend_options or {})
        )

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.req_pool.req_to_token

    def admit(self, prompts: Sequence[Sequence[int]], decoder_capacity: int) -> list[RequestAllocation]:
        """Allocate rows and pages for prompts, run the encoder, write every layer's cross K/V."""
        allocs: list[RequestAllocation] = []
        try:  # a failed allocation or encoder run must not leak the rows and pages already taken
            for p in prompts:
                allocs.append(self.memory.allocate(len(p), decoder_capacity))
            lens = [len(p) for p in prompts]
            ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=self.device)
            positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
            cu = torch.tensor(
                [0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=self.device
            )
            hidden = self.model.encode(ids, positions, cu, max(lens))
            loc = torch.cat([self.req_to_token[a.row, : a.encoder_len] for a in allocs]).long()
            self.model.write_cross_kv(hidden, loc, self.backend)
        except BaseException:
            self.release(allocs)
            raise
        return allocs

    def release(self, allocs: Sequence[RequestAllocation]) -> None:
        for a in allocs:
            self.memory.free(a)

    def step(
        self,
        mode: ForwardMode,
        allocs: Sequence[RequestAllocation],
        prefix_lens: Sequence[int],
        tokens: Sequence[Sequence[int]],
        draft_token_num: int | None = None,
    ) -> torch.Tensor:
        """Feed tokens[i] after prefix_lens[i] cached decoder tokens of request i -> fp32 logits [T, vocab]."""
        batch = build_batch(
            mode,
            self.req_to_token,
            [a.row for a in allocs],
            [a.encoder_len for a in allocs],
            prefix_lens,
            [len(t) for t in tokens],
            draft_token_num,
        )
        ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.int64, device=self.device)
        self.backend.init_forward_metadata(batch)
        hidden = self.model.decode(ids, batch.positions, batch, self.backend)
        return self.model.compute_logits(hidden)


@dataclass(frozen=True)
class SpeculativeResult:
    """Generated ids per prompt (stop token kept as the last id, as the engine does) and draft statistics."""

    token_ids: list[list[int]]
    proposed: int
    accepted: int
    target_steps: int

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens."""
        return self.accepted / self.proposed if self.proposed else 0.0


def _last_rows(counts: Sequence[int]) -> list[int]:
    """Index of each request's last token in a packed step of counts[i] tokens per request."""
    ends, total = [], 0
    for n in counts:
        total += n
        ends.append(total - 1)
    return ends


class SpeculativeDecoder:
    """Greedy generation of `target` accelerated by `draft` (see the module docstring)."""

    def __init__(
        self,
        target: ModelSession,
        draft: ModelSession,
        num_draft_tokens: int = 4,
        decoder_start_token_id: int | None = None,
    ) -> None:
        if num_draft_tokens < 1:
            raise ValidationError(f"num_draft_tokens = {num_draft_tokens}, must be >= 1")
        vt, vd = target.model.config.decoder.vocab_size, draft.model.config.decoder.vocab_size
        if vt != vd:
            raise ValidationError(
                f"draft vocabulary {vd} differs from the target's {vt}: they must share a tokenizer"
            )
        self.target = target
        self.draft = draft
        self.k = num_draft_tokens
        start = decoder_start_token_id
        self.start = target.model.config.decoder_start_token_id if start is None else start

    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_token_ids: Sequence[int] = ()
    ) -> SpeculativeResult:
        """Greedy tokens for every prompt, run as one batch until each stops or has max_new_tokens."""
        # The verify step writes up to k positions past the last output.
        capacity = max_new_tokens + self.k + 2
        t_alloc = self.target.admit(prompts, capacity)
        try:
            d_alloc = self.draft.admit(prompts, capacity)
        except BaseException:
            self.target.release(t_alloc)
            raise
        try:
            return self._generate(prompts, max_new_tokens, stop_token_ids, t_alloc, d_alloc)
        finally:  # an error mid-generation must not leave rows and pages allocated in either session
            self.target.release(t_alloc)
            self.draft.release(d_alloc)

    def _generate(self, prompts, max_new_tokens, stop_token_ids, t_alloc, d_alloc) -> SpeculativeResult:
        """generate() on memory already admitted in both sessions (the caller releases it)."""
        k, stop = self.k, set(stop_token_ids)
        n = len(prompts)
        committed = [[self.start] for _ in range(n)]
        outputs: list[list[int] | None] = [None] * n
        # Prefill: the target emits the first output; the draft reads [start, first] and proposes d1.
        first = self.target.step(ForwardMode.EXTEND, t_alloc, [0] * n, [[self.start]] * n).argmax(-1).tolist()
        for i in range(n):
            committed[i].append(first[i])
        proposed = accepted = 0
        target_steps = 1
        live = [i for i in range(n) if not self._finish(i, committed, outputs, max_new_tokens, stop)]
        d1: dict[int, int] = {}
        if live:
            logits = self.draft.step(
                ForwardMode.EXTEND, [d_alloc[i] for i in live], [0] * len(live), [committed[i] for i in live]
            )
            d1 = dict(zip(live, logits[_last_rows([2] * len(live))].argmax(-1).tolist(), strict=True))
        while live:
            drafts = {i: [d1[i]] for i in live}
            for j in range(1, k):  # draft DECODE steps: input d_j at decoder position m + j - 1
                logits = self.draft.step(
                    ForwardMode.DECODE,
                    [d_alloc[i] for i in live],
                    [len(committed[i]) + j - 1 for i in live],
                    [[drafts[i][-1]] for i in live],
                )
                for i, tok in zip(live, logits.argmax(-1).tolist(), strict=True):
                    drafts[i].append(tok)
            verify = self.target.step(
                ForwardMode.TARGET_VERIFY,
                [t_alloc[i] for i in live],
                [len(committed[i]) - 1 for i in live],
                [[committed[i][-1], *drafts[i]] for i in live],
                draft_token_num=k + 1,
            ).argmax(-1)
            target_steps += 1
            best = verify.view(len(live), k + 1).tolist()
            catch_up, catch_prefix = {}, {}
            for i, guesses in zip(live, best, strict=True):
                m = len(committed[i])
                n_ok = 0
                while n_ok < k and drafts[i][n_ok] == guesses[n_ok]:
                    n_ok += 1
                proposed += k
                accepted += n_ok
                committed[i] += [*drafts[i][:n_ok], guesses[n_ok]]
                # The draft's KV holds committed[:m] and d1..d(k-1); valid are those equal to committed.
                valid = m + min(n_ok, k - 1)
                catch_prefix[i], catch_up[i] = valid, committed[i][valid:]
            live = [i for i in live if not self._finish(i, committed, outputs, max_new_tokens, stop)]
            if not live:
                break
            logits = self.draft.step(
                ForwardMode.DRAFT_EXTEND_V2,
                [d_alloc[i] for i in live],
                [catch_prefix[i] for i in live],
                [catch_up[i] for i in live],
                draft_token_num=k + 1,
            )
            ends = _last_rows([len(catch_up[i]) for i in live])
            d1 = dict(zip(live, logits[ends].argmax(-1).tolist(), strict=True))
        return SpeculativeResult([o or [] for o in outputs], proposed, accepted, target_steps)

    @staticmethod
    def _finish(i: int, committed, outputs, max_new_tokens: int, stop: set[int]) -> bool:
        """Record request i's output if it is done (a stop token or max_new_tokens); True when done."""
        out = committed[i][1:]
        for pos, tok in enumerate(out[:max_new_tokens]):
            if tok in stop:
                outputs[i] = out[: pos + 1]
                return True
        if len(out) >= max_new_tokens:
            outputs[i] = out[:max_new_tokens]
            return True
        return False
