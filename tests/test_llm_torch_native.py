"""torch_native backend and the paged memory vs a dense per-request fp32 reference, randomized layouts."""

from __future__ import annotations

import random

import pytest
import torch

from mmgen.errors import MmgenError
from mmgen.llm.attention_layer import AttentionLayer
from mmgen.llm.backends import make_backend
from mmgen.llm.backends.layout import decoder_token_table, encoder_token_table, page_table
from mmgen.llm.forward_batch import ForwardBatch, ForwardMode, SpecInfo
from mmgen.llm.memory import KVPool, PageAllocator, ReqToTokenPool, RequestMemory

HEAD_DIM = 8
SLOTS = 1024  # per case; pages = SLOTS // page_size


def dense_reference(q, k, v, *, scale, softcap, causal_offset=None, window=None):
    """q [Lq, Hq, D], k/v [Lk, Hk, D]: explicit masked softmax. causal_offset = position of query 0."""
    group = q.shape[1] // k.shape[1]
    kf, vf = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kf) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if causal_offset is not None:
        qpos = torch.arange(q.shape[0])[:, None] + causal_offset
        kpos = torch.arange(k.shape[0])[None, :]
        visible = kpos <= qpos
        if window is not None:
            visible &= kpos > qpos - window
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf)


def shuffled_memory(rng: random.Random, page_size: int, max_reqs: int, max_context: int) -> RequestMemory:
    """Pools whose free lists are in random order, so requests get scattered rows and pages."""
    pages = PageAllocator(SLOTS // page_size, page_size)
    taken = pages.allocate(SLOTS // page_size)
    rng.shuffle(taken)
    pages.free(taken)
    req_pool = ReqToTokenPool(max_reqs, max_context)
    rows = [req_pool.allocate() for _ in range(max_reqs)]
    rng.shuffle(rows)
    for row in rows:
        req_pool.free(row)
    return RequestMemory(req_pool, pages)


def random_layout(mode: ForwardMode, rng: random.Random, window: int):
    """Per-request (encoder_len, prefix_len, query_len): distinct encoder lengths, prefixes 0 and > window."""
    batch_size = rng.randint(2, 6)
    encoder_lens = rng.sample(range(1, 30), batch_size)
    layout = []
    for i, enc in enumerate(encoder_lens):
        prefix = 0 if i % 3 == 0 else rng.randint(window + 1, 3 * window + 4)
        if mode is ForwardMode.DECODE or (mode is ForwardMode.MIXED and i % 2):
            prefix, qlen = max(prefix, 0), 1
        elif mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2):
            prefix, qlen = max(prefix, 1), 3
        else:
            qlen = rng.randint(1, 2 * window + 3)
        layout.append((enc, prefix, qlen))
    return layout


def build_case(mode: ForwardMode, page_size: int, seed: int, *, kv_heads: int, window: int):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    layout = random_layout(mode, rng, window)
    memory = shuffled_memory(rng, page_size, 8, 80)
    allocs = [memory.allocate(enc, prefix + qlen + rng.randint(0, 3)) for enc, prefix, qlen in layout]
    kv = KVPool(2, SLOTS // page_size, page_size, kv_heads, HEAD_DIM, torch.float32)
    table = memory.req_pool.req_to_token
    per_req = []  # (row, enc K/V, full decoder K/V) per layer id
    for alloc, (enc, prefix, qlen) in zip(allocs, layout, strict=True):
        layers = []
        for layer_id in range(2):
            ek, ev = torch.randn(2, enc, kv_heads, HEAD_DIM, generator=gen)
            dk, dv = torch.randn(2, prefix + qlen, kv_heads, HEAD_DIM, generator=gen)
            kv.set_kv(layer_id, table[alloc.row, :enc], ek, ev)
            kv.set_kv(layer_id, table[alloc.row, enc : enc + prefix], dk[:prefix], dv[:prefix])
            layers.append((ek, ev, dk, dv))
        per_req.append(layers)
    encs = torch.tensor([e for e, _, _ in layout], dtype=torch.int32)
    prefixes = torch.tensor([p for _, p, _ in layout], dtype=torch.int32)
    qlens = torch.tensor([n for _, _, n in layout], dtype=torch.int32)
    seq_lens = prefixes if mode is ForwardMode.DRAFT_EXTEND_V2 else prefixes + qlens
    extend = mode in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND_V2)
    batch = ForwardBatch(
        forward_mode=mode,
        batch_size=len(layout),
        req_pool_indices=torch.tensor([a.row for a in allocs]),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens,
        out_cache_loc=torch.cat(
            [table[a.row, e + p : e + p + n] for a, (e, p, n) in zip(allocs, layout, strict=True)]
        ).long(),
        positions=torch.cat([torch.arange(p, p + n) for _, p, n in layout]),
        extend_seq_lens=qlens if extend else None,
        extend_seq_lens_cpu=qlens if extend else None,
        extend_prefix_lens=prefixes if extend else None,
        extend_prefix_lens_cpu=prefixes if extend else None,
        encoder_lens=encs,
        encoder_lens_cpu=encs,
        spec_info=SpecInfo(3) if mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2) else None,
    )
    return memory, kv, batch, layout, per_req


MODES = [
    ForwardMode.EXTEND,
    ForwardMode.DECODE,
    ForwardMode.MIXED,
    ForwardMode.TARGET_VERIFY,
    ForwardMode.DRAFT_EXTEND_V2,
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kv_heads,softcap", [(2, 30.0), (4, 0.0)])
def test_torch_native_matches_dense_reference(mode, page_size, kv_heads, softcap):
    window = 5
    seed = MODES.index(mode) * 100 + page_size + kv_heads
    memory, kv, batch, layout, per_req = build_case(mode, page_size, seed, kv_heads=kv_heads, window=window)
    backend = make_backend("torch_native", memory.req_pool, kv)
    common = dict(num_q_heads=4, num_kv_heads=kv_heads, head_dim=HEAD_DIM, scaling=0.3, logit_softcap=softcap)
    sites = [
        AttentionLayer(layer_id=0, sliding_window=window, **common),
        AttentionLayer(layer_id=0, is_cross_attention=True, **common),
        AttentionLayer(layer_id=1, **common),
        AttentionLayer(layer_id=1, is_cross_attention=True, **common),
    ]
    gen = torch.Generator().manual_seed(seed + 1)
    total = sum(n for _, _, n in layout)
    q = torch.randn(total, 4, HEAD_DIM, generator=gen)
    new_k = {
        lid: torch.cat([r[lid][2][p:] for r, (_, p, _) in zip(per_req, layout, strict=True)])
        for lid in (0, 1)
    }
    new_v = {
        lid: torch.cat([r[lid][3][p:] for r, (_, p, _) in zip(per_req, layout, strict=True)])
        for lid in (0, 1)
    }
    backend.init_forward_metadata(batch)  # once for all layers of the step
    for site in sites:
        lid = site.layer_id
        if site.is_cross_attention:
            out = backend.forward(q, None, None, site, batch, save_kv_cache=False)
        else:
            out = backend.forward(q, new_k[lid], new_v[lid], site, batch)
            torch.testing.assert_close(kv.k_buffers[lid][batch.out_cache_loc], new_k[lid], atol=0, rtol=0)
        start = 0
        for reqs, (_, prefix, qlen) in zip(per_req, layout, strict=True):
            ek, ev, dk, dv = reqs[lid]
            qi = q[start : start + qlen]
            if site.is_cross_attention:
                ref = dense_reference(qi, ek, ev, scale=0.3, softcap=softcap)
            else:
                ref = dense_reference(
                    qi, dk, dv, scale=0.3, softcap=softcap, causal_offset=prefix, window=site.sliding_window
                )
            torch.testing.assert_close(out[start : start + qlen], ref, atol=1e-5, rtol=1e-5)
            start += qlen


def test_draft_extend_v2_reads_prefix_plus_extend():
    """DRAFT_EXTEND_V2 (seq_lens = prefix) gives the EXTEND result with seq_lens = prefix + extend."""
    memory, kv, batch, layout, per_req = build_case(ForwardMode.DRAFT_EXTEND_V2, 16, 5, kv_heads=2, window=5)
    backend = make_backend("torch_native", memory.req_pool, kv)
    site = AttentionLayer(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, scaling=0.3)
    q = torch.randn(batch.num_tokens, 4, HEAD_DIM)
    k = torch.cat([r[0][2][p:] for r, (_, p, _) in zip(per_req, layout, strict=True)])
    v = torch.cat([r[0][3][p:] for r, (_, p, _) in zip(per_req, layout, strict=True)])
    backend.init_forward_metadata(batch)
    draft = backend.forward(q, k, v, site, batch)
    batch.forward_mode = ForwardMode.EXTEND
    batch.seq_lens_cpu = batch.seq_lens_cpu + batch.extend_seq_lens_cpu
    batch.seq_lens = batch.seq_lens_cpu
    backend.init_forward_metadata(batch)
    torch.testing.assert_close(draft, backend.forward(q, k, v, site, batch), atol=0, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_rows_and_page_tables(page_size):
    """Encoder part first, decoder part on a fresh page; per-row views and page tables agree with the rows."""
    rng = random.Random(page_size)
    memory = shuffled_memory(rng, page_size, 6, 60)
    enc_lens, dec_caps = [7, 1, 18, 5], [9, 3, 20, 16]
    allocs = [memory.allocate(e, d) for e, d in zip(enc_lens, dec_caps, strict=True)]
    table = memory.req_pool.req_to_token
    slots_seen = set()
    for a, e, d in zip(allocs, enc_lens, dec_caps, strict=True):
        row = table[a.row, : e + d].tolist()
        assert row[e] % page_size == 0  # the decoder part starts a page
        assert len(set(row)) == e + d and not slots_seen & set(row)
        assert all(s // page_size != 0 for s in row)  # page 0 is the reserved scratch page
        slots_seen |= set(row)
    rows = torch.tensor([a.row for a in allocs])
    encs = torch.tensor(enc_lens, dtype=torch.int32)
    dec = decoder_token_table(table, rows, encs, max(dec_caps))
    enc = encoder_token_table(table, rows, max(enc_lens))
    for i, (a, e, d) in enumerate(zip(allocs, enc_lens, dec_caps, strict=True)):
        assert dec[i, :d].tolist() == table[a.row, e : e + d].tolist()
        assert enc[i, :e].tolist() == table[a.row, :e].tolist()
        pages = page_table(dec, page_size)[i, : -(-d // page_size)]
        expect = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:d]
        assert expect.tolist() == table[a.row, e : e + d].tolist()
    used = sum(-(-e // page_size) + -(-d // page_size) for e, d in zip(enc_lens, dec_caps, strict=True))
    assert memory.page_allocator.num_free() == SLOTS // page_size - used
    for a in allocs:
        memory.free(a)
    assert memory.page_allocator.num_free() == SLOTS // page_size and memory.req_pool.num_free() == 6
    with pytest.raises(MmgenError, match="freed but not in use"):
        memory.free(allocs[0])


def test_interface_guards():
    memory, kv, batch, _, _ = build_case(ForwardMode.DECODE, 16, 3, kv_heads=2, window=5)
    backend = make_backend("torch_native", memory.req_pool, kv)
    cross = AttentionLayer(
        layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, scaling=1.0, is_cross_attention=True
    )
    q = torch.randn(batch.num_tokens, 4, HEAD_DIM)
    k = torch.randn(batch.num_tokens, 2, HEAD_DIM)
    backend.init_forward_metadata(batch)
    with pytest.raises(MmgenError, match="cross-attention reads K/V from the encoder slots"):
        backend.forward(q, k, k, cross, batch)
    batch.forward_mode = ForwardMode.IDLE
    assert backend.forward(q[:0], None, None, cross, batch).shape == (0, 4, HEAD_DIM)
    with pytest.raises(MmgenError, match="eagerly only"):
        backend.init_cuda_graph_state(8, 8)
