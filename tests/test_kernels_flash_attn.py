"""mmgen.kernels.flash_attn against a naive per-(query, key) loop written here, over randomized paged layouts."""

from __future__ import annotations

import math
import types

import pytest
import torch

from mmgen import kernels as fa
from mmgen.errors import MmgenError, ValidationError

HQ, HK, D = 8, 2, 16
ATOL = 1e-5


def naive_attention(q, k, v, *, scale, causal=False, left=-1, right=-1, softcap=0.0):
    """q [Lq, Hq, D], k/v [Lk, Hk, D] -> (out [Lq, Hq, Dv], lse [Hq, Lq]) in float64 by explicit loops."""
    lq, hq, _ = q.shape
    lk, hk, _ = k.shape
    out = torch.zeros(lq, hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((hq, lq), float("-inf"), dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[:, h // (hq // hk)].double(), v[:, h // (hq // hk)].double()
        for i in range(lq):
            pos = i + lk - lq  # bottom-right aligned
            keep = [
                j
                for j in range(lk)
                if (not causal or j <= pos)
                and (left < 0 or j >= pos - left)
                and (right < 0 or j <= pos + right)
            ]
            if not keep:
                continue
            s = (kh[keep] @ q[i, h].double()) * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            m = s.max()
            w = torch.exp(s - m)
            out[i, h] = (w[:, None] * vh[keep]).sum(0) / w.sum()
            lse[h, i] = m + torch.log(w.sum())
    return out, lse


def naive_batch(q_list, kv_list, **kw):
    """Concatenate naive_attention over requests -> (out [total_q, Hq, Dv], lse [Hq, total_q])."""
    outs, lses = zip(
        *(naive_attention(q, k, v, **kw) for q, (k, v) in zip(q_list, kv_list, strict=True)), strict=True
    )
    return torch.cat(outs), torch.cat(lses, dim=1)


def assert_close(got, want, atol=ATOL):
    got, want = got.double(), want.double()
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "empty rows (-inf) differ"
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], atol=atol, rtol=1e-5), (got - want)[finite].abs().max()


class PagedLayout:
    """A paged K/V pool with randomly scattered pages; unused slots and a padding page hold NaN."""

    def __init__(self, lengths, page_size, gen, extra_cols=2):
        self.page_size = page_size
        self.lengths = list(lengths)
        pages_per = [math.ceil(n / page_size) for n in lengths]
        num_pages = sum(pages_per) + 3
        self.k_cache = torch.full((num_pages, page_size, HK, D), float("nan"))
        self.v_cache = torch.full((num_pages, page_size, HK, D), float("nan"))
        order = torch.randperm(num_pages - 1, generator=gen).tolist()
        poison = num_pages - 1  # never holds real tokens: reading it would put NaN in the output
        width = max(pages_per, default=0) + extra_cols
        self.page_table = torch.full((len(lengths), width), poison, dtype=torch.int32)
        self.keys, self.values = [], []
        for b, n in enumerate(lengths):
            kb, vb = torch.randn(n, HK, D, generator=gen), torch.randn(n, HK, D, generator=gen)
            self.keys.append(kb)
            self.values.append(vb)
            for p in range(pages_per[b]):
                page = order.pop()
                self.page_table[b, p] = page
                chunk = slice(p * page_size, min(n, (p + 1) * page_size))
                self.k_cache[page, : chunk.stop - chunk.start] = kb[chunk]
                self.v_cache[page, : chunk.stop - chunk.start] = vb[chunk]

    @property
    def seqlens(self):
        return torch.tensor(self.lengths, dtype=torch.int32)


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def random_batch(gen, *, max_batch=8, long_prefix=40):
    batch = int(torch.randint(1, max_batch + 1, (1,), generator=gen))
    q_lens = torch.randint(1, 6, (batch,), generator=gen).tolist()
    prefixes = torch.randint(0, long_prefix + 1, (batch,), generator=gen).tolist()
    prefixes[0] = 0  # always one request without a cached prefix
    if batch > 1:
        prefixes[1] = long_prefix  # and one longer than any window used here
    return q_lens, prefixes


# Gemma-like settings: a window shorter than the long prefixes, attention-logit softcap.
SETTINGS = [
    dict(causal=True, window_size=(-1, -1), softcap=0.0),
    dict(causal=True, window_size=(11, 0), softcap=0.0),
    dict(causal=True, window_size=(7, -1), softcap=20.0),
    dict(causal=False, window_size=(-1, -1), softcap=0.0),  # cross-attention over all keys
]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_kvcache_paged_varlen_matches_naive(page_size, setting):
    opts = SETTINGS[setting]
    gen = torch.Generator().manual_seed(10 * setting + page_size)
    q_lens, prefixes = random_batch(gen)
    lengths = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    layout = PagedLayout(lengths, page_size, gen)
    q = torch.randn(sum(q_lens), HQ, D, generator=gen)
    scale = 0.3
    out, lse = fa.flash_attn_with_kvcache(
        q,
        layout.k_cache,
        layout.v_cache,
        cache_seqlens=layout.seqlens,
        page_table=layout.page_table,
        cu_seqlens_q=cu(q_lens),
        max_seqlen_q=max(q_lens),
        softmax_scale=scale,
        return_softmax_lse=True,
        **opts,
    )
    left, right = opts["window_size"]
    want_out, want_lse = naive_batch(
        list(q.split(q_lens)),
        list(zip(layout.keys, layout.values, strict=True)),
        scale=scale,
        causal=opts["causal"],
        left=left,
        right=0 if opts["causal"] else right,
        softcap=opts["softcap"],
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (HQ, sum(q_lens)) and lse.dtype == torch.float32
    assert_close(out, want_out)
    assert_close(lse, want_lse)


def test_kvcache_batched_q_contiguous_cache_batch_idx_and_leftpad():
    gen = torch.Generator().manual_seed(1)
    batch, seq_q, cache_rows, cache_len = 3, 4, 5, 30
    k_cache = torch.randn(cache_rows, cache_len, HK, D, generator=gen)
    v_cache = torch.randn(cache_rows, cache_len, HK, D, generator=gen)
    batch_idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    seqlens = torch.tensor([9, 30, 17], dtype=torch.int32)
    leftpad = torch.tensor([0, 5, 3], dtype=torch.int32)
    q = torch.randn(batch, seq_q, HQ, D, generator=gen)
    out, lse = fa.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=seqlens,
        cache_batch_idx=batch_idx,
        cache_leftpad=leftpad,
        causal=True,
        window_size=(6, 0),
        softcap=15.0,
        return_softmax_lse=True,
    )
    assert out.shape == q.shape and lse.shape == (batch, HQ, seq_q)
    for b in range(batch):
        row, lo, hi = int(batch_idx[b]), int(leftpad[b]), int(seqlens[b])
        want_out, want_lse = naive_attention(
            q[b],
            k_cache[row, lo:hi],
            v_cache[row, lo:hi],
            scale=D**-0.5,
            causal=True,
            left=6,
            right=0,
            softcap=15.0,
        )
        assert_close(out[b], want_out)
        assert_close(lse[b], want_lse)


@pytest.mark.parametrize("page_size", [1, 16])
def test_kvcache_appends_new_tokens_in_place(page_size):
    gen = torch.Generator().manual_seed(2)
    cached, new_lens = [0, 13, 21], [3, 1, 2]
    layout = PagedLayout([c + n for c, n in zip(cached, new_lens, strict=True)], page_size, gen)
    # Blank the new tokens' slots: the call must write them.
    pos_pages = [(layout.page_table[b, p // page_size], p % page_size) for b in range(3) for p in range(cached[b], cached[b] + new_lens[b])]  # fmt: skip
    for page, slot in pos_pages:
        layout.k_cache[page, slot] = 0.0
        layout.v_cache[page, slot] = 0.0
    k_new = torch.cat([layout.keys[b][cached[b] :] for b in range(3)])
    v_new = torch.cat([layout.values[b][cached[b] :] for b in range(3)])
    q = torch.randn(sum(new_lens), HQ, D, generator=gen)
    out = fa.flash_attn_with_kvcache(
        q,
        layout.k_cache,
        layout.v_cache,
        k_new,
        v_new,
        cache_seqlens=torch.tensor(cached, dtype=torch.int32),
        page_table=layout.page_table,
        cu_seqlens_q=cu(new_lens),
        cu_seqlens_k_new=cu(new_lens),
        max_seqlen_q=max(new_lens),
        causal=True,
    )
    for b in range(3):
        got_k = fa.gather_paged(layout.k_cache, layout.page_table[b], cached[b] + new_lens[b])
        assert torch.equal(got_k, layout.keys[b])
    want, _ = naive_batch(
        list(q.split(new_lens)),
        list(zip(layout.keys, layout.values, strict=True)),
        scale=D**-0.5,
        causal=True,
    )
    assert_close(out, want)


@pytest.mark.parametrize("page_size", [1, 16])
def test_varlen_paged_fa4_style_and_ragged(page_size):
    gen = torch.Generator().manual_seed(3)
    q_lens, prefixes = random_batch(gen, max_batch=6)
    lengths = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    layout = PagedLayout(lengths, page_size, gen)
    q = torch.randn(sum(q_lens), HQ, D, generator=gen)
    common = dict(causal=True, window_size=(9, 0), softcap=25.0, return_lse=True)
    out, lse = fa.flash_attn_varlen_func(
        q,
        layout.k_cache,
        layout.v_cache,
        cu_seqlens_q=cu(q_lens),
        max_seqlen_q=max(q_lens),
        seqused_k=layout.seqlens,
        page_table=layout.page_table,
        **common,
    )
    want_out, want_lse = naive_batch(
        list(q.split(q_lens)),
        list(zip(layout.keys, layout.values, strict=True)),
        scale=D**-0.5,
        causal=True,
        left=9,
        right=0,
        softcap=25.0,
    )
    assert_close(out, want_out)
    assert_close(lse, want_lse)
    # Ragged keys, with seqused_k cutting each request's keys short of its cu_seqlens_k extent.
    k_packed = torch.cat([torch.cat([k, torch.randn(2, HK, D, generator=gen)]) for k in layout.keys])
    v_packed = torch.cat([torch.cat([v, torch.randn(2, HK, D, generator=gen)]) for v in layout.values])
    out2, lse2 = fa.flash_attn_varlen_func(
        q,
        k_packed,
        v_packed,
        cu_seqlens_q=cu(q_lens),
        cu_seqlens_k=cu([n + 2 for n in lengths]),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(lengths) + 2,
        seqused_k=layout.seqlens,
        **common,
    )
    assert_close(out2, want_out)
    assert_close(lse2, want_lse)


def test_flash_attn_func_dense_and_empty_rows():
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 6, HQ, D, generator=gen)
    k, v = torch.randn(2, 4, HK, D, generator=gen), torch.randn(2, 4, HK, D, generator=gen)
    out, lse = fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 6, HQ, D) and lse.shape == (2, HQ, 6)
    for b in range(2):
        want_out, want_lse = naive_attention(q[b], k[b], v[b], scale=D**-0.5, causal=True)
        assert_close(out[b], want_out)
        assert_close(lse[b], want_lse)
    # 6 queries over 4 keys, causal bottom-right: the first two queries see nothing -> 0 and -inf.
    assert torch.all(out[:, :2] == 0) and torch.all(torch.isneginf(lse[:, :, :2]))


def test_reference_computes_in_fp32_and_returns_query_dtype():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 3, HQ, D, generator=gen).to(torch.bfloat16)
    k, v = torch.randn(1, 7, HK, D, generator=gen).to(torch.bfloat16), torch.randn(1, 7, HK, D, generator=gen).to(torch.bfloat16)  # fmt: skip
    out, lse = fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want, _ = naive_attention(q[0].float(), k[0].float(), v[0].float(), scale=D**-0.5, causal=True)
    assert_close(out[0].float(), want.to(torch.bfloat16).float(), atol=1e-2)


def test_contract_violations_raise():
    gen = torch.Generator().manual_seed(6)
    layout = PagedLayout([20, 5], 4, gen, extra_cols=0)
    q = torch.randn(3, HQ, D, generator=gen)
    call = dict(page_table=layout.page_table, cu_seqlens_q=cu([2, 1]), max_seqlen_q=2)
    with pytest.raises(fa.KernelContractError, match="page_table row 0"):
        fa.flash_attn_with_kvcache(q, layout.k_cache, layout.v_cache, cache_seqlens=torch.tensor([24, 5], dtype=torch.int32), **call)  # fmt: skip
    with pytest.raises(fa.KernelContractError, match="int32"):
        fa.flash_attn_with_kvcache(
            q, layout.k_cache, layout.v_cache, cache_seqlens=torch.tensor([20, 5]), **call
        )
    with pytest.raises(fa.KernelContractError, match="max_seqlen_q=1"):
        fa.flash_attn_with_kvcache(q, layout.k_cache, layout.v_cache, cache_seqlens=layout.seqlens, **{**call, "max_seqlen_q": 1})  # fmt: skip
    with pytest.raises(fa.KernelContractError, match="rotary_cos"):
        fa.flash_attn_with_kvcache(q, layout.k_cache, layout.v_cache, cache_seqlens=layout.seqlens, rotary_cos=torch.zeros(4, 2), **call)  # fmt: skip
    with pytest.raises(fa.KernelContractError, match="max_seqlen_k=10"):
        fa.flash_attn_varlen_func(q, layout.k_cache, layout.v_cache, cu_seqlens_q=cu([2, 1]), seqused_k=layout.seqlens, page_table=layout.page_table, max_seqlen_k=10)  # fmt: skip
    assert issubclass(fa.KernelContractError, MmgenError)


def _decode_call(layout, q, metadata, **over):
    call = dict(
        cache_seqlens=layout.seqlens,
        page_table=layout.page_table,
        causal=True,
        window_size=(-1, -1),
        softcap=30.0,
        scheduler_metadata=metadata,
    )
    call.update(over)
    return fa.flash_attn_with_kvcache(q, layout.k_cache, layout.v_cache, **call)


def test_scheduler_metadata_validates_its_call():
    gen = torch.Generator().manual_seed(7)
    layout = PagedLayout([9, 30, 1, 17], 16, gen)
    q = torch.randn(4, 1, HQ, D, generator=gen)
    provider = fa.ReferenceFlashAttention()

    def metadata(window=(-1, -1), seqlens=None, batch=4, softcap=True):
        return provider.get_scheduler_metadata(
            batch,
            1,
            64,
            HQ,
            HK,
            D,
            layout.seqlens[:batch] if seqlens is None else seqlens,
            page_size=16,
            causal=True,
            window_size=window,
            has_softcap=softcap,
        )

    global_md, window_md = metadata(), metadata(window=(11, 0))
    info = fa.describe_scheduler_metadata(window_md)
    assert (info.batch_size, info.window_left, info.window_right, info.causal) == (4, 11, 0, False)
    assert info.cache_seqlens == (9, 30, 1, 17) and info.page_size == 16 and info.has_softcap
    # Matching calls run and equal the call without metadata.
    plain = _decode_call(layout, q, None)
    assert torch.equal(_decode_call(layout, q, global_md), plain)
    _decode_call(layout, q, window_md, window_size=(11, 0))
    # A sliding-window layer reusing the global layers' metadata, and the reverse.
    with pytest.raises(fa.KernelContractError, match="window_left"):
        _decode_call(layout, q, global_md, window_size=(11, 0))
    with pytest.raises(fa.KernelContractError, match="window_left"):
        _decode_call(layout, q, window_md)
    # Metadata from another batch: other size, or stale lengths (not recomputed on replay).
    with pytest.raises(fa.KernelContractError, match="batch_size"):
        _decode_call(layout, q, metadata(batch=3))
    with pytest.raises(fa.KernelContractError, match="cache_seqlens"):
        _decode_call(layout, q, metadata(seqlens=torch.tensor([8, 30, 1, 17], dtype=torch.int32)))
    with pytest.raises(fa.KernelContractError, match="has_softcap"):
        _decode_call(layout, q, metadata(softcap=False))
    with pytest.raises(fa.KernelContractError, match="not made by"):
        _decode_call(layout, q, torch.zeros(8, dtype=torch.int32))
    assert provider.calls["get_scheduler_metadata"] == 5


def test_reference_provider_counts_calls_and_loader():
    provider = fa.load_flash_attention_provider("reference")
    assert isinstance(provider, fa.ReferenceFlashAttention) and provider.supports_paged_kv
    gen = torch.Generator().manual_seed(8)
    layout = PagedLayout([5, 3], 1, gen)
    q = torch.randn(2, 1, HQ, D, generator=gen)
    for _ in range(3):
        provider.flash_attn_with_kvcache(q, layout.k_cache, layout.v_cache, cache_seqlens=layout.seqlens, page_table=layout.page_table)  # fmt: skip
    provider.flash_attn_varlen_func(q[:, 0], layout.k_cache, layout.v_cache, cu_seqlens_q=cu([1, 1]), seqused_k=layout.seqlens, page_table=layout.page_table)  # fmt: skip
    provider.get_scheduler_metadata(2, 1, 5, HQ, HK, D, layout.seqlens)
    assert provider.calls == {
        "flash_attn_with_kvcache": 3,
        "flash_attn_varlen_func": 1,
        "get_scheduler_metadata": 1,
    }
    assert fa.ReferenceFlashAttention().calls == {}  # counts live on the instance, not the module
    with pytest.raises(ValidationError, match="fa5"):
        fa.load_flash_attention_provider("fa5")
    if not torch.cuda.is_available():
        assert isinstance(
            fa.load_flash_attention_provider("auto", paged_kv=True, window=True), fa.ReferenceFlashAttention
        )
        for name in ("fa3", "fa4"):
            with pytest.raises(MmgenError, match=name):
                fa.load_flash_attention_provider(name)


def fake_fa4_varlen(q, k, v, **kw):
    """Stands in for flash_attn.cute.flash_attn_varlen_func: FA4's keywords, (out, lse|None) always, None windows."""
    window = kw.pop("window_size")
    assert all(w is None or w >= 0 for w in window), window  # FA4 needs None for unbounded
    assert kw.pop("num_splits") == 1
    return_lse = kw.pop("return_lse")
    batched = kw.get("cu_seqlens_q") is None
    if batched:
        b, s = q.shape[:2]
        kw["cu_seqlens_q"] = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)
        q = q.reshape(b * s, *q.shape[2:])
    if kw.get("page_table") is None:  # a batched [B, S, Hk, D] cache: pack it with cu_seqlens_k
        rows, length = k.shape[:2]
        kw["cu_seqlens_k"] = torch.arange(0, (rows + 1) * length, length, dtype=torch.int32)
        k, v = k.reshape(rows * length, *k.shape[2:]), v.reshape(rows * length, *v.shape[2:])
    out, lse = fa.flash_attn_varlen_func(q, k, v, window_size=window, return_lse=True, **kw)
    if batched:
        out, lse = out.reshape(b, s, *out.shape[1:]), lse.reshape(lse.shape[0], b, s).transpose(0, 1)
    return out, (lse if return_lse else None)


@pytest.mark.parametrize("page_size", [1, 16])
def test_fa4_adapter_runs_kvcache_contract_through_varlen(page_size):
    gen = torch.Generator().manual_seed(9)
    q_lens, prefixes = random_batch(gen, max_batch=5)
    lengths = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    layout = PagedLayout(lengths, page_size, gen)
    q = torch.randn(sum(q_lens), HQ, D, generator=gen)
    adapter = fa.FA4FlashAttention(fake_fa4_varlen)
    reference = fa.ReferenceFlashAttention()
    call = dict(
        cache_seqlens=layout.seqlens,
        page_table=layout.page_table,
        cu_seqlens_q=cu(q_lens),
        max_seqlen_q=max(q_lens),
        causal=True,
        window_size=(5, -1),
        softcap=10.0,
        return_softmax_lse=True,
    )
    got = adapter.flash_attn_with_kvcache(q, layout.k_cache, layout.v_cache, **call)
    want = reference.flash_attn_with_kvcache(q, layout.k_cache, layout.v_cache, **call)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])
    assert adapter.get_scheduler_metadata(len(q_lens), max(q_lens), 64, HQ, HK, D, layout.seqlens) is None
    decode_q = torch.randn(len(q_lens), 1, HQ, D, generator=gen)
    one = dict(cache_seqlens=layout.seqlens, page_table=layout.page_table, window_size=(-1, -1))
    assert_close(
        adapter.flash_attn_with_kvcache(decode_q, layout.k_cache, layout.v_cache, **one),
        reference.flash_attn_with_kvcache(decode_q, layout.k_cache, layout.v_cache, **one),
    )
    assert adapter.calls == {"flash_attn_with_kvcache": 2, "get_scheduler_metadata": 1}
    with pytest.raises(fa.KernelContractError, match="scheduler_metadata"):
        adapter.flash_attn_with_kvcache(decode_q, layout.k_cache, layout.v_cache, scheduler_metadata=torch.zeros(3), **one)  # fmt: skip


def test_fa4_adapter_appends_into_the_callers_cache():
    gen = torch.Generator().manual_seed(10)
    k_cache, v_cache = torch.randn(4, 12, HK, D, generator=gen), torch.randn(4, 12, HK, D, generator=gen)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    k_new, v_new = torch.randn(2, 2, HK, D, generator=gen), torch.randn(2, 2, HK, D, generator=gen)
    q = torch.randn(2, 2, HQ, D, generator=gen)
    call = dict(cache_seqlens=torch.tensor([3, 7], dtype=torch.int32), cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32), causal=True)  # fmt: skip
    got = fa.FA4FlashAttention(fake_fa4_varlen).flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, **call
    )
    want = fa.flash_attn_with_kvcache(q, ref_k, ref_v, k_new, v_new, **call)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert torch.equal(k_cache[2, 3:5], k_new[0]) and torch.equal(v_cache[0, 7:9], v_new[1])
    assert_close(got, want)


def test_fa3_adapter_normalizes_returns_and_respects_build_flags():
    seen = {}

    def kvcache(q, k_cache, v_cache, k=None, v=None, **kw):
        seen["kvcache"] = kw
        out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **{**kw, "return_softmax_lse": True})
        return (out, lse, torch.empty(0), torch.empty(0)) if kw.get("return_softmax_lse") else out

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        seen["varlen"] = kw
        return fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kw)

    module = types.SimpleNamespace(__name__="fa3_fwd_interface", flash_attn_with_kvcache=kvcache, flash_attn_varlen_func=varlen)  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    layout = PagedLayout([6, 2], 16, gen)
    q = torch.randn(2, HQ, D, generator=gen)
    full = fa.FA3FlashAttention(module, {})
    out, lse = full.flash_attn_varlen_func(q, layout.k_cache, layout.v_cache, cu_seqlens_q=cu([1, 1]), max_seqlen_q=1, seqused_k=layout.seqlens, page_table=layout.page_table, return_lse=True)  # fmt: skip
    assert torch.equal(
        seen["kvcache"]["cache_seqlens"], layout.seqlens
    )  # paged varlen goes through FA3's kvcache entry
    want_out, want_lse = fa.flash_attn_varlen_func(q, layout.k_cache, layout.v_cache, cu_seqlens_q=cu([1, 1]), seqused_k=layout.seqlens, page_table=layout.page_table, return_lse=True)  # fmt: skip
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    k_packed, v_packed = torch.cat(layout.keys), torch.cat(layout.values)
    _, lse2 = full.flash_attn_varlen_func(q, k_packed, v_packed, cu_seqlens_q=cu([1, 1]), cu_seqlens_k=cu([6, 2]), max_seqlen_q=1, max_seqlen_k=6, window_size=(3, None), return_lse=True)  # fmt: skip
    assert seen["varlen"]["return_attn_probs"] is True and seen["varlen"]["window_size"] == (3, -1)
    assert lse2.shape == (HQ, 2)
    fwd_only = fa.FA3FlashAttention(module, {"FLASHATTENTION_DISABLE_PAGEDKV": True, "FLASHATTENTION_DISABLE_LOCAL": True})  # fmt: skip
    assert not fwd_only.supports_paged_kv and not fwd_only.supports_window
    with pytest.raises(fa.KernelContractError, match="paged KV"):
        fwd_only.flash_attn_with_kvcache(q[:, None], layout.k_cache, layout.v_cache, cache_seqlens=layout.seqlens, page_table=layout.page_table)  # fmt: skip
    with pytest.raises(fa.KernelContractError, match="sliding windows"):
        fwd_only.flash_attn_varlen_func(q, k_packed, v_packed, cu_seqlens_q=cu([1, 1]), cu_seqlens_k=cu([6, 2]), window_size=(3, 0))  # fmt: skip


def test_auto_provider_is_the_reference_for_cpu_or_fp32_data():
    """Real kernels take neither CPU tensors nor fp32: "auto" must not hand them such data on a GPU host."""
    from mmgen.kernels import gpu_kernels_apply, load_flash_attention_provider
    from mmgen.kernels.flashinfer_providers import load_flashinfer_provider

    assert not gpu_kernels_apply("cpu", torch.bfloat16)
    assert not gpu_kernels_apply("cuda", torch.float32)
    assert gpu_kernels_apply("cuda", torch.bfloat16) and gpu_kernels_apply(None, None)
    for device, dtype in (("cpu", torch.float32), ("cpu", torch.bfloat16), ("cuda", torch.float32)):
        assert load_flash_attention_provider("auto", device=device, dtype=dtype).name == "reference"
        assert load_flashinfer_provider("auto", device=device, dtype=dtype).name == "reference"


@pytest.mark.parametrize("gather_keys", [False, True], ids=["in-place", "gathered"])
def test_padded_rows_as_varlen_match_each_rows_valid_keys(gather_keys):
    """pack_padded_rows: padded [B, S, H, D] rows with key lengths -> one varlen call -> rows again; each
    row equals attention over its own valid keys (in place via seqused_k, or with the keys gathered)."""
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(3, 4, HQ, D, generator=gen)
    k, v = torch.randn(3, 6, HK, D, generator=gen), torch.randn(3, 6, HK, D, generator=gen)
    lengths = torch.tensor([6, 1, 4], dtype=torch.int32)
    rows = fa.pack_padded_rows(q, k, v, lengths, gather_keys=gather_keys)
    assert (rows.seqused_k is None) == gather_keys and rows.k.shape[0] == (11 if gather_keys else 18)
    out, lse = fa.flash_attn_varlen_func(rows.q, rows.k, rows.v, **rows.keywords(), return_lse=True)
    out, lse = rows.rows(out), rows.lse_rows(lse)
    assert out.shape == (3, 4, HQ, D) and lse.shape == (3, HQ, 4)
    for b, length in enumerate(lengths.tolist()):
        want_out, want_lse = naive_attention(q[b], k[b, :length], v[b, :length], scale=D**-0.5)
        assert_close(out[b], want_out)
        assert_close(lse[b], want_lse)
    same_for_all = fa.pack_padded_rows(q, k, v, 4)
    assert same_for_all.seqused_k.tolist() == [4, 4, 4] and fa.pack_padded_rows(q, k, v).seqused_k is None


def test_fa2_adapter_takes_gathered_keys_and_refuses_what_fa2_lacks():
    """FA2's signatures (no seqused_k, no page_table, return_attn_probs -> (out, lse, S)): the diffusion impl
    gathers the valid keys for it and gets the reference's result."""
    from mmgen.attention import AttentionMetadata, FlashAttentionImpl

    def varlen(
        q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale=None, causal=False, return_attn_probs=False
    ):
        out, lse = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal, return_lse=True)  # fmt: skip
        return (out, lse, torch.empty(0)) if return_attn_probs else out

    def dense(q, k, v, *, softmax_scale=None, causal=False):
        return fa.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)

    adapter = fa.FA2FlashAttention(types.SimpleNamespace(__name__="flash_attn", flash_attn_func=dense, flash_attn_varlen_func=varlen))  # fmt: skip
    assert (adapter.module, adapter.has_seqused_k, adapter.supports_paged_kv) == ("flash_attn", False, False)
    adapter.on_gpu = False  # its stand-in functions run on CPU tensors
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(2, 5, HQ, D, generator=gen) for _ in range(3))
    impl = FlashAttentionImpl("reference")
    impl.kernel = adapter  # as FlashAttentionImpl("fa2") holds it where flash-attn is installed
    for meta in (AttentionMetadata(), AttentionMetadata(cu_seqlens_k=cu([2, 5]))):
        assert_close(impl(q, k, v, meta), FlashAttentionImpl("reference")(q, k, v, meta))
    assert adapter.calls == {"flash_attn_func": 1, "flash_attn_varlen_func": 1}
    _, lse = adapter.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu([5]), cu_seqlens_k=cu([5]), max_seqlen_q=5, max_seqlen_k=5, return_lse=True)  # fmt: skip
    assert lse.shape == (HQ, 5)
    with pytest.raises(fa.KernelContractError, match="seqused_k"):
        adapter.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu([5]), cu_seqlens_k=cu([5]), seqused_k=torch.tensor([3], dtype=torch.int32))  # fmt: skip
    with pytest.raises(fa.KernelContractError, match="kvcache"):
        adapter.flash_attn_with_kvcache(q, k, v)
