"""mmgen.kernels.flashinfer against a naive per-(query, key) loop written here, over randomized paged layouts."""

from __future__ import annotations

import math

import pytest
import torch

from mmgen.errors import MmgenError, ValidationError
from mmgen.kernels import flash_attn as fa
from mmgen.kernels import flashinfer as fi
from mmgen.kernels import flashinfer_providers as fip

HQ, HK, D = 8, 2, 16
ATOL = 1e-5
LOG2E = 1.0 / math.log(2.0)


def naive_fi(q, k, v, *, sm_scale, causal=False, window_left=-1, soft_cap=0.0, mask=None):
    """q [qo, Hq, D], k/v [kv, Hk, D] -> (out [qo, Hq, Dv], base-2 lse [qo, Hq]) in float64 by explicit loops.

    FlashInfer's rule: query i sits at kv - qo + i; a custom mask replaces causal, the window still applies.
    """
    qo, hq, _ = q.shape
    kv, hk, _ = k.shape
    out = torch.zeros(qo, hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((qo, hq), float("-inf"), dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[:, h // (hq // hk)].double(), v[:, h // (hq // hk)].double()
        for i in range(qo):
            pos = kv - qo + i
            keep = []
            for j in range(kv):
                allowed = bool(mask[i, j]) if mask is not None else (not causal or j <= pos)
                if allowed and (window_left < 0 or j >= pos - window_left):
                    keep.append(j)
            if not keep:
                continue
            s = (kh[keep] @ q[i, h].double()) * sm_scale
            if soft_cap > 0:
                s = soft_cap * torch.tanh(s / soft_cap)
            m = s.max()
            w = torch.exp(s - m)
            out[i, h] = (w[:, None] * vh[keep]).sum(0) / w.sum()
            lse[i, h] = (m + torch.log(w.sum())) * LOG2E
    return out, lse


def assert_close(got, want, atol=ATOL):
    got, want = got.double(), want.double()
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "empty rows (-inf) differ"
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], atol=atol, rtol=1e-5), (got - want)[finite].abs().max()


def indptr(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)


class Pool:
    """Paged K/V (NHD) with randomly scattered pages; unused slots hold NaN so over-reads show."""

    def __init__(self, lengths, page_size, gen, num_pages=None):
        self.page_size = page_size
        pages_per = [math.ceil(n / page_size) for n in lengths]
        num_pages = num_pages or sum(pages_per) + 2
        self.k = torch.full((num_pages, page_size, HK, D), float("nan"))
        self.v = torch.full((num_pages, page_size, HK, D), float("nan"))
        order = torch.randperm(num_pages, generator=gen).tolist()
        self.rows, self.keys, self.values = [], [], []
        for n, count in zip(lengths, pages_per, strict=True):
            kb, vb = torch.randn(n, HK, D, generator=gen), torch.randn(n, HK, D, generator=gen)
            row = [order.pop() for _ in range(count)]
            for p, page in enumerate(row):
                chunk = slice(p * page_size, min(n, (p + 1) * page_size))
                self.k[page, : chunk.stop - chunk.start] = kb[chunk]
                self.v[page, : chunk.stop - chunk.start] = vb[chunk]
            self.rows.append(row)
            self.keys.append(kb)
            self.values.append(vb)

    def paged_args(self, lengths, first_page=None):
        """(indptr, indices, last_page_len) for the first `lengths` tokens (starting at page first_page[i])."""
        first_page = first_page or [0] * len(lengths)
        counts, indices, last = [], [], []
        for row, start, n in zip(self.rows, first_page, lengths, strict=True):
            pages = row[start : start + math.ceil(n / self.page_size)]
            counts.append(len(pages))
            indices += pages
            # An empty request says last_page_len = page_size: FlashInfer's custom-mask offsets count
            # (pages - 1) * page_size + last_page_len tokens for it, which must come to 0, not below.
            last.append(n - (len(pages) - 1) * self.page_size if pages else self.page_size)
        return indptr(counts), torch.tensor(indices, dtype=torch.int32), torch.tensor(last, dtype=torch.int32)


def workspace():
    return torch.empty(1024, dtype=torch.uint8)


def random_requests(gen, max_batch=6):
    batch = int(torch.randint(1, max_batch + 1, (1,), generator=gen))
    qo = torch.randint(1, 6, (batch,), generator=gen).tolist()
    prefix = torch.randint(0, 41, (batch,), generator=gen).tolist()
    prefix[0] = 0
    if batch > 1:
        prefix[1] = 40
    return qo, prefix


@pytest.mark.parametrize("window_left,soft_cap", [(-1, 0.0), (6, 0.0), (9, 30.0)])
def test_ragged_prefill_matches_naive(window_left, soft_cap):
    gen = torch.Generator().manual_seed(window_left + 100)
    qo, prefix = random_requests(gen)
    kv = [p + n for p, n in zip(prefix, qo, strict=True)]  # ragged keys may be longer than the queries
    q = torch.randn(sum(qo), HQ, D, generator=gen)
    k, v = torch.randn(sum(kv), HK, D, generator=gen), torch.randn(sum(kv), HK, D, generator=gen)
    wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace(), "NHD")
    wrapper.plan(
        indptr(qo),
        indptr(kv),
        HQ,
        HK,
        D,
        causal=True,
        window_left=window_left,
        logits_soft_cap=soft_cap,
        sm_scale=0.25,
        q_data_type=torch.float32,
    )
    out, lse = wrapper.run(q, k, v, return_lse=True)
    want = [
        naive_fi(qb, kb, vb, sm_scale=0.25, causal=True, window_left=window_left, soft_cap=soft_cap)
        for qb, kb, vb in zip(q.split(qo), k.split(kv), v.split(kv), strict=True)
    ]
    assert out.shape == q.shape and lse.shape == (sum(qo), HQ)
    assert_close(out, torch.cat([o for o, _ in want]))
    assert_close(lse, torch.cat([s for _, s in want]))
    _, lse_hn = wrapper.run(q, k, v, return_lse=True, lse_layout="HN", lse_base="ln")
    assert_close(lse_hn, torch.cat([s for _, s in want]).T / LOG2E)


@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_prefill_causal_and_custom_mask_match_naive(page_size):
    gen = torch.Generator().manual_seed(page_size)
    qo, prefix = random_requests(gen)
    kv = [p + n for p, n in zip(prefix, qo, strict=True)]
    pool = Pool(kv, page_size, gen)
    q = torch.randn(sum(qo), HQ, D, generator=gen)
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")
    # Causal over prefix + new tokens, all in the cache, with window and softcap.
    wrapper.plan(indptr(qo), *pool.paged_args(kv), HQ, HK, D, page_size, causal=True, window_left=7, logits_soft_cap=20.0, q_data_type=torch.float32)  # fmt: skip
    out, lse = wrapper.run_return_lse(q, (pool.k, pool.v))
    want = [
        naive_fi(qb, kb, vb, sm_scale=D**-0.5, causal=True, window_left=7, soft_cap=20.0)
        for qb, kb, vb in zip(q.split(qo), pool.keys, pool.values, strict=True)
    ]
    assert_close(out, torch.cat([o for o, _ in want]))
    assert_close(lse, torch.cat([s for _, s in want]))
    # A random custom mask replaces causal (causal=True is ignored with it); the window still applies.
    masks = [torch.rand(n, m, generator=gen) < 0.6 for n, m in zip(qo, kv, strict=True)]
    flat = torch.cat([m.reshape(-1) for m in masks])
    wrapper.plan(indptr(qo), *pool.paged_args(kv), HQ, HK, D, page_size, custom_mask=flat, causal=True, window_left=12, q_data_type=torch.float32)  # fmt: skip
    out, lse = wrapper.run(q, (pool.k, pool.v), return_lse=True)
    want = [
        naive_fi(qb, kb, vb, sm_scale=D**-0.5, window_left=12, mask=m)
        for qb, kb, vb, m in zip(q.split(qo), pool.keys, pool.values, masks, strict=True)
    ]
    assert_close(out, torch.cat([o for o, _ in want]))
    assert_close(lse, torch.cat([s for _, s in want]))
    # The 5-D single-tensor cache and the HND layout read the same keys.
    wrapper.plan(indptr(qo), *pool.paged_args(kv), HQ, HK, D, page_size, causal=True, q_data_type=torch.float32)  # fmt: skip
    ref = wrapper.run(q, (pool.k, pool.v))
    assert torch.equal(wrapper.run(q, torch.stack([pool.k, pool.v], dim=1)), ref)
    hnd = fi.BatchPrefillWithPagedKVCacheWrapper(workspace(), "HND")
    hnd.plan(indptr(qo), *pool.paged_args(kv), HQ, HK, D, page_size, causal=True, q_data_type=torch.float32)
    assert torch.equal(hnd.run(q, (pool.k.transpose(1, 2), pool.v.transpose(1, 2))), ref)


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_matches_naive(page_size):
    gen = torch.Generator().manual_seed(20 + page_size)
    batch = 7
    kv = torch.randint(1, 50, (batch,), generator=gen).tolist()
    kv[0] = 1
    pool = Pool(kv, page_size, gen)
    q = torch.randn(batch, HQ, D, generator=gen)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD")
    wrapper.plan(*pool.paged_args(kv), HQ, HK, D, page_size, window_left=10, logits_soft_cap=30.0, q_data_type=torch.float32)  # fmt: skip
    out, lse = wrapper.run(q, (pool.k, pool.v), return_lse=True)
    assert out.shape == (batch, HQ, D) and lse.shape == (batch, HQ)
    for b in range(batch):
        want_o, want_s = naive_fi(q[b : b + 1], pool.keys[b], pool.values[b], sm_scale=D**-0.5, window_left=10, soft_cap=30.0)  # fmt: skip
        assert_close(out[b : b + 1], want_o)
        assert_close(lse[b : b + 1], want_s)
    # Tensor-core decode with 3 queries per request (speculative verify): causal inside each request.
    tc = fi.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=True)
    kv3 = [n + 2 for n in kv]
    pool3 = Pool(kv3, page_size, gen)
    q3 = torch.randn(batch * 3, HQ, D, generator=gen)
    tc.plan(*pool3.paged_args(kv3), HQ, HK, D, page_size, q_len_per_req=3, q_data_type=torch.float32)
    out3 = tc.run(q3, (pool3.k, pool3.v))
    for b in range(batch):
        want_o, _ = naive_fi(
            q3[3 * b : 3 * b + 3], pool3.keys[b], pool3.values[b], sm_scale=D**-0.5, causal=True
        )
        assert_close(out3[3 * b : 3 * b + 3], want_o)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [-1, 8])
def test_extend_as_ragged_plus_trimmed_paged_prefix_merges_to_whole(page_size, window):
    """The FlashInfer extend: new tokens ragged + causal, prefix paged + non-causal (trimmed to the window,
    a custom mask keeping each query inside its own window), each with LSE, merged by merge_state."""
    gen = torch.Generator().manual_seed(30 + page_size + window)
    qo, prefix = random_requests(gen)
    kv = [p + n for p, n in zip(prefix, qo, strict=True)]
    pool = Pool(kv, page_size, gen)  # the whole sequence is cached; the prefix is its first tokens
    q = torch.randn(sum(qo), HQ, D, generator=gen)
    new_k = torch.cat([k[p:] for k, p in zip(pool.keys, prefix, strict=True)])
    new_v = torch.cat([v[p:] for v, p in zip(pool.values, prefix, strict=True)])
    ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace(), "NHD")
    ragged.plan(indptr(qo), indptr(qo), HQ, HK, D, causal=True, window_left=window, logits_soft_cap=25.0, q_data_type=torch.float32)  # fmt: skip
    o_new, s_new = ragged.run(q, new_k, new_v, return_lse=True)
    # Keep the pages holding the last `window` prefix tokens; the mask drops what is still too old.
    first_page, kept, masks = [], [], []
    for p, n in zip(prefix, qo, strict=True):
        start_page = max(0, p - window) // page_size if window >= 0 else 0
        start = start_page * page_size
        first_page.append(start_page)
        kept.append(p - start)
        absolute = torch.arange(start, p)[None, :]
        query_pos = torch.arange(p, p + n)[:, None]
        keep = absolute >= query_pos - window if window >= 0 else torch.ones(n, p - start, dtype=torch.bool)
        masks.append(keep.reshape(-1))
    paged = fi.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")
    paged.plan(indptr(qo), *pool.paged_args(kept, first_page), HQ, HK, D, page_size, custom_mask=torch.cat(masks), causal=False, window_left=window, logits_soft_cap=25.0, q_data_type=torch.float32)  # fmt: skip
    o_pre, s_pre = paged.run(q, (pool.k, pool.v), return_lse=True)
    provider = fip.ReferenceFlashInfer()
    merged_o, merged_s = provider.merge_state(o_pre, s_pre, o_new, s_new)
    want = [
        naive_fi(qb, kb, vb, sm_scale=D**-0.5, causal=True, window_left=window, soft_cap=25.0)
        for qb, kb, vb in zip(q.split(qo), pool.keys, pool.values, strict=True)
    ]
    assert_close(merged_o, torch.cat([o for o, _ in want]))
    assert_close(merged_s, torch.cat([s for _, s in want]))
    assert paged.plan_info.window_left == window and ragged.plan_info.window_left == window


def test_merge_state_edge_cases_and_variants():
    gen = torch.Generator().manual_seed(40)
    n = 5
    v_a, v_b = torch.randn(n, HQ, D, generator=gen), torch.randn(n, HQ, D, generator=gen)
    s_a, s_b = torch.randn(n, HQ, generator=gen) * 3, torch.randn(n, HQ, generator=gen) * 3
    s_b[0] = float("-inf")  # an empty segment: the other side wins unchanged
    s_a[1] = float("-inf")
    s_b[1] = float("-inf")  # both empty: 0 and -inf, no NaN
    v, s = fip.merge_state(v_a, s_a, v_b, s_b)
    assert_close(v[0], v_a[0])
    assert_close(s[0], s_a[0])
    assert torch.all(v[1] == 0) and torch.all(torch.isneginf(s[1]))
    w_a = 2 ** s_a[2:] / (2 ** s_a[2:] + 2 ** s_b[2:])
    assert_close(v[2:], v_a[2:] * w_a[..., None] + v_b[2:] * (1 - w_a[..., None]))
    assert_close(s[2:], torch.log2(2 ** s_a[2:] + 2 ** s_b[2:]))
    # merge_states over a third state equals two merge_state steps; the in-place form matches too.
    v_c, s_c = torch.randn(n, HQ, D, generator=gen), torch.randn(n, HQ, generator=gen)
    v3, s3 = fip.merge_states(torch.stack([v_a, v_b, v_c], 1), torch.stack([s_a, s_b, s_c], 1))
    v2, s2 = fip.merge_state(v, s, v_c, s_c)
    assert_close(v3, v2)
    assert_close(s3, s2)
    v_in, s_in = v.clone(), s.clone()
    rows = torch.tensor([True, False, True, True, False])
    fip.merge_state_in_place(v_in, s_in, v_c, s_c, mask=rows)
    assert_close(v_in[rows], v2[rows])
    assert torch.equal(v_in[~rows], v[~rows])


def test_lse_base_two_equals_flash_attention_natural_lse_times_log2e():
    gen = torch.Generator().manual_seed(50)
    qo, kv = [3, 1, 4], [9, 1, 12]
    q = torch.randn(sum(qo), HQ, D, generator=gen)
    k, v = torch.randn(sum(kv), HK, D, generator=gen), torch.randn(sum(kv), HK, D, generator=gen)
    _, fa_lse = fa.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=indptr(qo),
        cu_seqlens_k=indptr(kv),
        causal=True,
        window_size=(4, 0),
        return_lse=True,
    )
    wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace())
    wrapper.plan(indptr(qo), indptr(kv), HQ, HK, D, causal=True, window_left=4, q_data_type="float32")
    _, fi_lse = wrapper.run(q, k, v, return_lse=True)
    assert fa_lse.shape == (HQ, sum(qo)) and fi_lse.shape == (sum(qo), HQ)
    assert_close(fi_lse, fa_lse.T * fi.LOG2E)
    assert_close(fi_lse / fi.LOG2E, fa_lse.T)


def test_plan_run_contract_violations_raise():
    gen = torch.Generator().manual_seed(60)
    kv = [5, 20]
    pool = Pool(kv, 16, gen)
    q = torch.randn(2, HQ, D, generator=gen)
    decode = fi.BatchDecodeWithPagedKVCacheWrapper(workspace())
    with pytest.raises(fi.KernelContractError, match="before plan"):
        decode.run(q, (pool.k, pool.v))
    decode.plan(*pool.paged_args(kv), HQ, HK, D, 16, window_left=4)  # q_data_type defaults to float16
    with pytest.raises(fi.KernelContractError, match="q_data_type"):
        decode.run(q, (pool.k, pool.v))
    decode.plan(*pool.paged_args(kv), HQ, HK, D, 16, window_left=4, q_data_type=torch.float32)
    decode.run(q, (pool.k, pool.v), window_left=4)
    with pytest.raises(fi.KernelContractError, match="window_left"):
        decode.run(q, (pool.k, pool.v), window_left=-1)
    with pytest.raises(TypeError):  # FlashInfer's decode plan takes its options by keyword
        decode.plan(*pool.paged_args(kv), HQ, HK, D, 16, "NONE")
    ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace())
    with pytest.raises(fi.KernelContractError, match="custom_mask has 3 entries"):
        ragged.plan(indptr([1, 1]), indptr([2, 2]), HQ, HK, D, custom_mask=torch.ones(3, dtype=torch.bool))
    paged = fi.BatchPrefillWithPagedKVCacheWrapper(workspace())
    no_pages = (indptr([0, 2]), torch.tensor(pool.rows[1][:2], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32))  # fmt: skip
    with pytest.raises(fi.KernelContractError, match="go negative"):
        paged.plan(indptr([2, 1]), *no_pages, HQ, HK, D, 16, custom_mask=torch.ones(20, dtype=torch.bool))
    with pytest.raises(fi.KernelContractError, match="last_page_len"):
        paged.plan(
            indptr([2, 1]), *pool.paged_args(kv)[:2], torch.tensor([5, 17], dtype=torch.int32), HQ, HK, D, 16
        )
    # A planned index tensor changed without re-planning: the kernels would run a stale schedule.
    args = pool.paged_args(kv)
    paged.plan(indptr([1, 1]), *args, HQ, HK, D, 16, q_data_type=torch.float32)
    args[2][1] = 3
    with pytest.raises(fi.KernelContractError, match="last_page_len changed"):
        paged.run(q, (pool.k, pool.v))


def test_cuda_graph_mode_plans_into_static_buffers():
    gen = torch.Generator().manual_seed(70)
    batch, page_size = 3, 16
    buffers = dict(
        paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32),
        paged_kv_indices_buffer=torch.zeros(64, dtype=torch.int32),
        paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32),
    )
    graph = fi.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_cuda_graph=True, **buffers)
    eager = fi.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD")
    for step, kv in enumerate(([3, 17, 40], [4, 18, 41])):
        pool = Pool(kv, page_size, gen)
        q = torch.randn(batch, HQ, D, generator=gen)
        for wrapper in (graph, eager):
            wrapper.plan(*pool.paged_args(kv), HQ, HK, D, page_size, q_data_type=torch.float32)
        assert torch.equal(buffers["paged_kv_last_page_len_buffer"], pool.paged_args(kv)[2]), step
        assert torch.equal(graph.run(q, (pool.k, pool.v)), eager.run(q, (pool.k, pool.v)))
    buffers["paged_kv_last_page_len_buffer"][0] = 2  # replay metadata written without plan()
    with pytest.raises(fi.KernelContractError, match="changed after plan"):
        graph.run(q, (pool.k, pool.v))
    with pytest.raises(fi.KernelContractError, match="fixed at 3"):
        graph.plan(
            *Pool(kv[:2], page_size, gen).paged_args(kv[:2]), HQ, HK, D, page_size, q_data_type=torch.float32
        )
    with pytest.raises(fi.KernelContractError, match="CUDA graph mode"):
        fi.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_cuda_graph=True)


def test_packed_custom_mask_for_one_request_equals_bool_mask():
    gen = torch.Generator().manual_seed(80)
    qo, kv = [5], [11]
    q = torch.randn(5, HQ, D, generator=gen)
    k, v = torch.randn(11, HK, D, generator=gen), torch.randn(11, HK, D, generator=gen)
    mask = torch.rand(55, generator=gen) < 0.5
    mask[::11] = True
    packed, _ = fi._pack_segments(mask, [55])
    assert packed.numel() == 7 and int(packed[0]) == sum(int(b) << i for i, b in enumerate(mask[:8].tolist()))
    wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace())
    wrapper.plan(indptr(qo), indptr(kv), HQ, HK, D, custom_mask=mask, q_data_type=torch.float32)
    from_bool = wrapper.run(q, k, v)
    wrapper.plan(indptr(qo), indptr(kv), HQ, HK, D, packed_custom_mask=packed, q_data_type=torch.float32)
    assert torch.equal(wrapper.run(q, k, v), from_bool)
    want, _ = naive_fi(q, k, v, sm_scale=D**-0.5, mask=mask.reshape(5, 11))
    assert_close(from_bool, want)


def test_reference_provider_counts_plan_run_and_loader():
    provider = fip.load_flashinfer_provider("reference")
    assert isinstance(provider, fip.ReferenceFlashInfer)
    gen = torch.Generator().manual_seed(90)
    pool = Pool([4, 9], 1, gen)
    decode = provider.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD")
    decode.plan(*pool.paged_args([4, 9]), HQ, HK, D, 1, q_data_type=torch.float32)
    q = torch.randn(2, HQ, D, generator=gen)
    for _ in range(3):
        decode.run(q, (pool.k, pool.v))
    ragged = provider.BatchPrefillWithRaggedKVCacheWrapper(workspace(), "NHD")
    ragged.plan(indptr([1, 1]), indptr([1, 1]), HQ, HK, D, causal=True, q_data_type=torch.float32)
    o, s = ragged.run(q, pool.keys[0][:2], pool.values[0][:2], return_lse=True)
    provider.merge_state(o, s, o, s)
    assert provider.calls == {
        "BatchDecodeWithPagedKVCacheWrapper.plan": 1,
        "BatchDecodeWithPagedKVCacheWrapper.run": 3,
        "BatchPrefillWithRaggedKVCacheWrapper.plan": 1,
        "BatchPrefillWithRaggedKVCacheWrapper.run": 1,
        "merge_state": 1,
    }
    with pytest.raises(ValidationError, match="flashinfer2"):
        fip.load_flashinfer_provider("flashinfer2")
    if not torch.cuda.is_available():
        assert isinstance(fip.load_flashinfer_provider("auto"), fip.ReferenceFlashInfer)
        with pytest.raises(MmgenError, match="flashinfer"):
            fip.load_flashinfer_provider("flashinfer")
