"""Diffusion attention impls against an explicit dense fp32 per-row loop; metadata is never mutated."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmgen.attention import (
    AttentionImpl,
    AttentionMetadata,
    DiTAttention,
    FlashAttentionImpl,
    SDPAImpl,
    select_attention,
)
from mmgen.attention.impls import padded_keys_attention
from mmgen.errors import ValidationError
from mmgen.kernels import ReferenceFlashAttention


def loop_attention(q, k, v, lengths_q=None, lengths_k=None, scale=None):
    """Per row, per head: softmax(q k^T * scale) v over the row's valid keys, float64; padded queries 0."""
    batch, seq_q, heads, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.zeros(batch, seq_q, heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        lq = seq_q if lengths_q is None else int(lengths_q[b])
        lk = k.shape[1] if lengths_k is None else int(lengths_k[b])
        if lk == 0:
            continue
        for h in range(heads):
            qb, kb, vb = q[b, :lq, h].double(), k[b, :lk, h].double(), v[b, :lk, h].double()
            out[b, :lq, h] = torch.softmax(qb @ kb.T * scale, dim=-1) @ vb
    return out


def random_qkv(batch=3, seq_q=9, seq_k=7, heads=2, head_dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape_q, shape_k = (batch, seq_q, heads, head_dim), (batch, seq_k, heads, head_dim)
    return (
        torch.randn(shape_q, generator=gen),
        torch.randn(shape_k, generator=gen),
        torch.randn(shape_k, generator=gen),
    )


IMPLS = [SDPAImpl(), FlashAttentionImpl("reference")]


@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.provider)
def test_dense_matches_loop(impl):
    q, k, v = random_qkv()
    out = impl(q, k, v, AttentionMetadata())
    assert out.shape == q.shape and out.dtype == q.dtype
    assert (out.double() - loop_attention(q, k, v)).abs().max().item() <= 1e-5
    scaled = impl(q, k, v, AttentionMetadata(), scale=0.3)
    assert (scaled.double() - loop_attention(q, k, v, scale=0.3)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.provider)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_varlen_matches_loop(impl, seed):
    q, k, v = random_qkv(batch=4, seq_q=11, seq_k=13, seed=seed)
    gen = torch.Generator().manual_seed(100 + seed)
    lengths_q = torch.randint(1, 12, (4,), generator=gen)
    lengths_k = torch.randint(1, 14, (4,), generator=gen)
    for lq, lk in ((lengths_q, lengths_k), (None, lengths_k), (lengths_q, None)):
        meta = AttentionMetadata.from_lengths(lq, lk)
        out = impl(q, k, v, meta)
        expected = loop_attention(q, k, v, lq, lk)
        assert (out.double() - expected).abs().max().item() <= 1e-5
        if lq is not None:
            for b in range(4):
                assert torch.count_nonzero(out[b, int(lq[b]) :]) == 0


def test_flash_reference_equals_sdpa_varlen_and_empty_rows():
    q, k, v = random_qkv(batch=3, seq_q=6, seq_k=8, seed=7)
    meta = AttentionMetadata.from_lengths(torch.tensor([6, 2, 4]), torch.tensor([8, 0, 3]))
    a = FlashAttentionImpl("reference")(q, k, v, meta)
    b = SDPAImpl()(q, k, v, meta)
    assert torch.isfinite(b).all() and torch.count_nonzero(b[1]) == 0  # no visible key: zeros, not NaN
    assert (a - b).abs().max().item() <= 1e-5


def test_packed_keys_path_matches_in_place_path():
    """The FA2 path (no seqused_k: keys gathered to a packed layout) gives the same result."""
    q, k, v = random_qkv(batch=3, seq_q=5, seq_k=9, seed=11)
    lengths_k = torch.tensor([9, 1, 4], dtype=torch.int32)
    kernel = ReferenceFlashAttention()
    packed = ReferenceFlashAttention()
    packed.has_seqused_k = False
    in_place = padded_keys_attention(kernel, q, k, v, lengths_k, 0.25)
    # keys gathered to a packed layout: other shapes, fp32 rounding of O(1) outputs at most (equal here)
    assert (padded_keys_attention(packed, q, k, v, lengths_k, 0.25) - in_place).abs().max().item() <= 1e-5
    assert (in_place.double() - loop_attention(q, k, v, None, lengths_k, 0.25)).abs().max().item() <= 1e-5


def test_metadata_is_immutable():
    meta = AttentionMetadata.from_lengths(None, torch.tensor([3, 5]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.cu_seqlens_k = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.max_seqlen_k = 99
    pair = DiTAttention(self_attn=AttentionMetadata(), cross_attn=meta)
    with pytest.raises(dataclasses.FrozenInstanceError):
        pair.cross_attn = AttentionMetadata()


@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.provider)
def test_impl_leaves_metadata_tensors_unchanged(impl):
    q, k, v = random_qkv(batch=2, seq_q=6, seq_k=5)
    meta = AttentionMetadata.from_lengths(torch.tensor([6, 3]), torch.tensor([2, 5]))
    before = (meta.cu_seqlens_q.clone(), meta.cu_seqlens_k.clone(), meta.max_seqlen_q, meta.max_seqlen_k)
    versions = (meta.cu_seqlens_q._version, meta.cu_seqlens_k._version)
    impl(q, k, v, meta)
    impl(q, k, v, meta)
    assert torch.equal(meta.cu_seqlens_q, before[0]) and torch.equal(meta.cu_seqlens_k, before[1])
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == before[2:]
    assert (meta.cu_seqlens_q._version, meta.cu_seqlens_k._version) == versions  # not even written in place


def test_impls_satisfy_the_protocol():
    for impl in IMPLS:
        assert isinstance(impl, AttentionImpl)
    assert (IMPLS[0].name, IMPLS[0].provider) == ("sdpa", "sdpa")
    assert (IMPLS[1].name, IMPLS[1].provider) == ("flash", "reference")


def test_select_attention_names_and_errors():
    cpu = {"device": "cpu", "dtype": torch.float32, "head_dim": 64}
    assert select_attention("auto", **cpu).provider == "sdpa"
    assert select_attention("sdpa", **cpu).provider == "sdpa"
    assert select_attention("flash", **cpu).provider == "reference"
    assert select_attention("flash:reference", **cpu).provider == "reference"
    for bad in ("x", "flash3", "flash:fa5", "", "SDPA"):
        with pytest.raises(
            ValidationError, match=r"unknown attention backend .*; allowed: auto, flash, sdpa"
        ):
            select_attention(bad, **cpu)
    for explicit in ("flash:fa3", "flash:fa4", "flash:fa2"):
        with pytest.raises(ValidationError, match=explicit):
            select_attention(explicit, **cpu)
    cuda_fp32 = {"device": torch.device("cuda"), "dtype": torch.float32, "head_dim": 64}
    assert select_attention("auto", **cuda_fp32).provider == "sdpa"
    with pytest.raises(ValidationError, match="bfloat16 or float16"):
        select_attention("flash", **cuda_fp32)
    with pytest.raises(ValidationError, match="unknown FlashAttention provider"):
        FlashAttentionImpl("fa9")


def test_gpu_provider_refuses_cpu_fp32_tensors():
    impl = FlashAttentionImpl("reference")
    impl.kernel.on_gpu = True  # a stand-in for a GPU provider
    q, k, v = random_qkv()
    with pytest.raises(ValidationError, match="bfloat16/float16 CUDA"):
        impl(q, k, v, AttentionMetadata())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_flash_matches_reference():
    impl = select_attention("flash", device="cuda", dtype=torch.bfloat16, head_dim=128)
    q, k, v = (t.cuda().bfloat16() for t in random_qkv(batch=2, seq_q=300, seq_k=77, heads=4, head_dim=128))
    metas = [AttentionMetadata(), AttentionMetadata.from_lengths(None, torch.tensor([77, 20], device="cuda"))]
    for meta in metas:
        out = impl(q, k, v, meta).float()
        expected = FlashAttentionImpl("reference")(q, k, v, meta).float()
        assert (out - expected).abs().max().item() <= 2e-2, impl.provider
