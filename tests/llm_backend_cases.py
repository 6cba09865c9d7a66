"""Randomized paged-KV batches for the backend tests (a helper module, not a test file).

Builds real pools (ReqToTokenPool, PageAllocator, RequestMemory, KVPool) with random K/V, one row
per request with its own encoder length, and a ForwardBatch in any mode following the seq_lens
conventions of mmgen.llm.forward_batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from mmgen.llm.attention_layer import AttentionLayer
from mmgen.llm.forward_batch import ForwardBatch, ForwardMode, SpecInfo
from mmgen.llm.memory import KVPool, PageAllocator, ReqToTokenPool, RequestMemory


@dataclass
class Case:
    """Pools, a batch and matching q/k/v for one randomized step."""

    req_pool: ReqToTokenPool
    kv_pool: KVPool
    batch: ForwardBatch
    layers: list[AttentionLayer]
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hk, D]
    v: torch.Tensor  # [T, Hk, D]
    prefix_lens: list[int]
    query_lens: list[int]
    encoder_lens: list[int]


def make_layers(num_q_heads: int, num_kv_heads: int, head_dim: int, window: int | None, softcap: float):
    """Decoder sites of a 2-layer model: sliding self, cross, global self, cross."""
    common = dict(
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scaling=head_dim**-0.5
    )
    return [
        AttentionLayer(layer_id=0, sliding_window=window, logit_softcap=softcap, **common),
        AttentionLayer(layer_id=0, logit_softcap=softcap, is_cross_attention=True, **common),
        AttentionLayer(layer_id=1, logit_softcap=softcap, **common),
        AttentionLayer(layer_id=1, logit_softcap=softcap, is_cross_attention=True, **common),
    ]


def _distinct(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return rng.sample(range(lo, hi + 1), n)


def make_case(
    mode: ForwardMode,
    *,
    seed: int,
    batch_size: int,
    page_size: int,
    window: int | None = 8,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    softcap: float = 0.0,
    long_prefix: bool = True,
    draft_token_num: int = 3,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    max_encoder: int = 40,
) -> Case:
    """A random step: every encoder length different; prefixes 0 and longer than the window mixed."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    b = batch_size
    encoder_lens = _distinct(rng, b, 1, max(max_encoder, b + 1))
    w = window or 8
    prefix_lens, query_lens = [], []
    for i in range(b):
        if mode is ForwardMode.DECODE:
            p = rng.randint(w + 1, 3 * w + 5) if (long_prefix and i % 3 != 1) else rng.randint(0, w)
            prefix_lens.append(p)
            query_lens.append(1)
        elif mode is ForwardMode.TARGET_VERIFY:
            prefix_lens.append(rng.randint(w + 1, 3 * w) if long_prefix else rng.randint(1, w))
            query_lens.append(draft_token_num)
        elif mode is ForwardMode.DRAFT_EXTEND_V2:
            prefix_lens.append(
                rng.randint(w + 1, 3 * w) if (long_prefix and i % 2 == 0) else rng.randint(1, w)
            )
            query_lens.append(rng.randint(1, draft_token_num + 1))
        elif mode is ForwardMode.MIXED:
            is_decode = i % 2 == 1
            p = (
                rng.randint(1, 3 * w)
                if is_decode
                else (rng.randint(w + 1, 3 * w) if long_prefix and i % 4 == 0 else 0)
            )
            prefix_lens.append(p)
            query_lens.append(1 if is_decode else rng.randint(1, 2 * w + 3))
        else:  # EXTEND
            p = 0 if i % 3 == 0 or not long_prefix else rng.randint(w + 1, 3 * w)
            prefix_lens.append(p)
            query_lens.append(rng.randint(1, 2 * w + 3))
    max_dec = max(p + q for p, q in zip(prefix_lens, query_lens, strict=True))
    max_context = max(encoder_lens) + max_dec + 2 * page_size + 8
    num_pages = sum(-(-e // page_size) + -(-(max_dec + 4) // page_size) for e in encoder_lens) + 16
    req_pool = ReqToTokenPool(b + 3, max_context, device=device)
    pages = PageAllocator(num_pages, page_size)
    memory = RequestMemory(req_pool, pages)
    # A throwaway first request shuffles which rows and pages the real ones get.
    spare = memory.allocate(rng.randint(1, 5), rng.randint(1, 5))
    allocs = [memory.allocate(e, max_dec + 4) for e in encoder_lens]
    memory.free(spare)
    kv_pool = KVPool(2, num_pages, page_size, num_kv_heads, head_dim, dtype, device=device)
    for buf in kv_pool.k_buffers + kv_pool.v_buffers:
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    rows = torch.tensor([a.row for a in allocs], dtype=torch.int64)
    table = req_pool.req_to_token
    out_loc, positions = [], []
    for a, e, p, q in zip(allocs, encoder_lens, prefix_lens, query_lens, strict=True):
        out_loc.append(table[a.row, e + p : e + p + q].long())
        positions.append(torch.arange(p, p + q))
    ext = torch.tensor(query_lens, dtype=torch.int32)
    pre = torch.tensor(prefix_lens, dtype=torch.int32)
    if mode is ForwardMode.DRAFT_EXTEND_V2:
        seq_lens = pre
    else:
        seq_lens = pre + ext
    extend_like = mode is not ForwardMode.DECODE
    enc = torch.tensor(encoder_lens, dtype=torch.int32)
    batch = ForwardBatch(
        forward_mode=mode,
        batch_size=b,
        req_pool_indices=rows.to(device),
        seq_lens=seq_lens.to(device),
        seq_lens_cpu=seq_lens.clone(),
        out_cache_loc=torch.cat(out_loc).to(device),
        positions=torch.cat(positions).to(device),
        extend_seq_lens=ext.to(device) if extend_like else None,
        extend_seq_lens_cpu=ext.clone() if extend_like else None,
        extend_prefix_lens=pre.to(device) if extend_like else None,
        extend_prefix_lens_cpu=pre.clone() if extend_like else None,
        encoder_lens=enc.to(device),
        encoder_lens_cpu=enc.clone(),
        spec_info=SpecInfo(draft_token_num)
        if mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2)
        else None,
    )
    t = int(ext.sum())
    q = torch.randn(t, num_q_heads, head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(t, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    layers = make_layers(num_q_heads, num_kv_heads, head_dim, window, softcap)
    return Case(req_pool, kv_pool, batch, layers, q, k, v, prefix_lens, query_lens, encoder_lens)


def run_layers(backend, case: Case) -> list[torch.Tensor]:
    """init_forward_metadata once, then every layer of the case; returns each layer's output."""
    backend.init_forward_metadata(case.batch)
    outs = []
    for layer in case.layers:
        if layer.is_cross_attention:
            outs.append(backend.forward(case.q, None, None, layer, case.batch, save_kv_cache=False))
        else:
            outs.append(backend.forward(case.q, case.k, case.v, layer, case.batch))
    return outs


def tiny_t5gemma(
    *,
    seed: int,
    layers: int = 2,
    hidden: int = 32,
    window: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
):
    """A tiny random mmgen T5Gemma (vocab 128, sliding/global alternating, softcaps on), fp32, CPU."""
    from mmgen.llm.models.t5gemma import T5GemmaConfig, T5GemmaForConditionalGeneration, T5GemmaStackConfig

    types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))
    stack = T5GemmaStackConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        layer_types=types,
        sliding_window=window,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=20.0,
        final_logit_softcapping=15.0,
    )
    torch.manual_seed(seed)
    model = T5GemmaForConditionalGeneration(T5GemmaConfig(encoder=stack, decoder=stack)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = 0.3 / hidden**0.5 if "embed" in name else (0.1 if "norm" in name else 0.3)
            param.copy_(torch.randn(param.shape, generator=gen) * std)
    return model


def random_prompts(seed: int, lengths) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in lengths]


def random_layout(seed: int) -> dict:
    """make_case keywords for a random layout: mode, batch 1-16, page 1/16, GQA group, window, softcap."""
    rng = random.Random(seed)
    modes = [
        ForwardMode.EXTEND,
        ForwardMode.DECODE,
        ForwardMode.MIXED,
        ForwardMode.TARGET_VERIFY,
        ForwardMode.DRAFT_EXTEND_V2,
    ]
    hq, hk = rng.choice([(4, 2), (8, 2), (4, 4), (6, 3), (8, 1)])
    return dict(
        mode=rng.choice(modes),
        seed=seed,
        batch_size=rng.randint(1, 16),
        page_size=rng.choice([1, 16]),
        num_q_heads=hq,
        num_kv_heads=hk,
        window=rng.randint(2, 10),
        softcap=rng.choice([0.0, 25.0]),
        draft_token_num=rng.randint(1, 4),
    )


def idle_batch(device: str = "cpu") -> ForwardBatch:
    """An IDLE step: no requests, no tokens."""
    e = torch.zeros(0, dtype=torch.int32, device=device)
    return ForwardBatch(
        ForwardMode.IDLE,
        0,
        e.long(),
        e,
        e.cpu(),
        e.long(),
        e.long(),
        encoder_lens=e,
        encoder_lens_cpu=e.cpu(),
    )
