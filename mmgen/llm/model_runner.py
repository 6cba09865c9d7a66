"""Turns scheduled requests into model calls: one encoder pass for newcomers, one decoder step for all.

Step layout (the engine's choice): newcomers' prompts run through the encoder together (packed
varlen), their cross-attention K/V are written into their encoder slots for every decoder layer,
then ONE decoder forward covers every running request with one token each: a newcomer feeds the
decoder start token (an EXTEND of 1 token, prefix 0), the others their last sampled token (DECODE).
The batch is DECODE when nobody is new, EXTEND when everybody is, MIXED otherwise.
"""

from __future__ import annotations

import torch

from mmgen.llm.backends.base import AttentionBackend
from mmgen.llm.cuda_graph_runner import CudaGraphRunner
from mmgen.llm.forward_batch import ForwardBatch, ForwardMode
from mmgen.llm.memory import ReqToTokenPool
from mmgen.llm.models.t5gemma import T5GemmaForConditionalGeneration
from mmgen.llm.scheduler import Request


class ModelRunner:
    """Owns nothing but references: the model, the req_to_token pool and the backend over the KV pool."""

    def __init__(
        self,
        model: T5GemmaForConditionalGeneration,
        req_pool: ReqToTokenPool,
        backend: AttentionBackend,
        graph_runner: CudaGraphRunner | None = None,
    ):
        self.model = model
        self.req_pool = req_pool
        self.backend = backend
        self.graph_runner = graph_runner
        self.device = next(model.parameters()).device

    def _int_tensor(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def encode(self, reqs: list[Request]) -> None:
        """Run the encoder over reqs' prompts and store every decoder layer's cross K/V in their encoder slots."""
        lens = [r.encoder_len for r in reqs]
        ids = self._int_tensor([t for r in reqs for t in r.prompt_ids], torch.int64)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        cu_seqlens = self._int_tensor([0, *torch.tensor(lens).cumsum(0).tolist()], torch.int32)
        hidden = self.model.encode(ids, positions, cu_seqlens, max(lens))
        table = self.req_pool.req_to_token
        loc = torch.cat([table[r.allocation.row, : r.encoder_len] for r in reqs]).long()
        self.model.write_cross_kv(hidden, loc, self.backend)

    def build_decode_batch(self, reqs: list[Request]) -> ForwardBatch:
        """One token per request at its decoder position (0 = a newcomer's start token: EXTEND)."""
        positions = [r.decoder_position for r in reqs]
        num_new = positions.count(0)
        enc_lens = [r.encoder_len for r in reqs]
        rows = self._int_tensor([r.allocation.row for r in reqs], torch.int64)
        pos = self._int_tensor(positions, torch.int64)
        enc = self._int_tensor(enc_lens, torch.int32)
        out_cache_loc = self.req_pool.req_to_token[rows, enc.long() + pos].long()
        seq_lens_cpu = torch.tensor(positions, dtype=torch.int32) + 1
        if num_new == 0:
            mode = ForwardMode.DECODE
        elif num_new == len(reqs):
            mode = ForwardMode.EXTEND
        else:
            mode = ForwardMode.MIXED
        batch = ForwardBatch(
            forward_mode=mode,
            batch_size=len(reqs),
            req_pool_indices=rows,
            seq_lens=seq_lens_cpu.to(self.device),
            seq_lens_cpu=seq_lens_cpu,
            out_cache_loc=out_cache_loc,
            positions=pos,
            encoder_lens=enc,
            encoder_lens_cpu=torch.tensor(enc_lens, dtype=torch.int32),
        )
        if mode is not ForwardMode.DECODE:
            ones = torch.ones(len(reqs), dtype=torch.int32)
            prefix = torch.tensor(positions, dtype=torch.int32)
            batch.extend_seq_lens, batch.extend_seq_lens_cpu = ones.to(self.device), ones
            batch.extend_prefix_lens, batch.extend_prefix_lens_cpu = prefix.to(self.device), prefix
        return batch

    def decode(self, reqs: list[Request], decoder_start_token_id: int) -> torch.Tensor:
        """One decoder step for reqs -> fp32 logits [len(reqs), vocab]."""
        tokens = [r.output_ids[-1] if r.output_ids else decoder_start_token_id for r in reqs]
        batch = self.build_decode_batch(reqs)
        ids = self._int_tensor(tokens, torch.int64)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch, ids)
        self.backend.init_forward_metadata(batch)
        hidden = self.model.decode(ids, batch.positions, batch, self.backend)
        return self.model.compute_logits(hidden)
