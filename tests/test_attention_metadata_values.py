"""AttentionMetadata is a value: no impl fills in or reuses what a call left in it (the seed-002 bug).

The bug guarded here: an impl that writes a None max_seqlen_q/k into the metadata it was given
(object.__setattr__ gets past frozen=True) and then uses the stored number instead of the current
call's tensor shapes. One metadata object then carries one call's lengths into the next: a dense
object used for 12 keys and then 5, or shared by self-attention (video tokens) and cross-attention
(text tokens). Every impl and provider that runs on CPU is checked, against a float64 loop.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_attention import loop_attention, random_qkv
from wan_cases import TINY

from mmgen.attention import AttentionMetadata, DiTAttention, FlashAttentionImpl, select_attention
from mmgen.attention.selection import BACKEND_NAMES
from mmgen.errors import ValidationError
from mmgen.models.wan import WanDiT


def cpu_impls() -> dict[str, object]:
    """Every backend name that resolves on CPU (one impl per distinct provider), plus FlashAttention's
    packed-keys path (the FA2 route, no seqused_k) run on the reference kernel."""
    found: dict[str, object] = {}
    for name in BACKEND_NAMES:
        try:
            impl = select_attention(name, device="cpu", dtype=torch.float32, head_dim=16)
        except ValidationError:  # a GPU-only name
            continue
        found.setdefault(f"{impl.name}:{impl.provider}", impl)
    packed = FlashAttentionImpl("reference")
    packed.kernel.has_seqused_k = False
    found["flash:reference-packed-keys"] = packed
    return found


IMPLS = cpu_impls()
# (query tokens, key tokens) per call: longer, shorter, longer again - a stored length is wrong both ways.
CALL_SHAPES = ((9, 12), (4, 5), (9, 12))


def _fields(meta: AttentionMetadata) -> dict[str, object]:
    return {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}


def _snapshot(meta: AttentionMetadata) -> dict[str, object]:
    """Each field's value; for a tensor (the object, a copy of its values, its in-place write counter)."""
    return {
        name: (value, value.clone(), value._version) if isinstance(value, torch.Tensor) else value
        for name, value in _fields(meta).items()
    }


def _assert_unchanged(meta: AttentionMetadata, before: dict[str, object], where: str) -> None:
    for name, value in _fields(meta).items():
        held = before[name]
        if isinstance(held, tuple):
            tensor, values, version = held
            assert value is tensor, f"{where}: {name} replaced"
            assert torch.equal(value, values) and value._version == version, f"{where}: {name} written"
        else:
            assert value == held, f"{where}: {name} {held!r} -> {value!r}"


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
def test_one_dense_metadata_for_calls_of_different_lengths(impl):
    """One AttentionMetadata() serves 12 keys, then 5, then 12: its fields stay None, every output is right."""
    meta = AttentionMetadata()
    for i, (seq_q, seq_k) in enumerate(CALL_SHAPES):
        q, k, v = random_qkv(batch=2, seq_q=seq_q, seq_k=seq_k, seed=i)
        out = impl(q, k, v, meta)
        assert all(value is None for value in _fields(meta).values()), _fields(meta)
        assert out.shape == q.shape
        assert (out.double() - loop_attention(q, k, v)).abs().max().item() <= 1e-5, (seq_q, seq_k)


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
def test_varlen_metadata_without_max_lengths_for_calls_of_different_lengths(impl):
    """cu_seqlens given, max_seqlen left None: the max lengths come from each call, never from the last one."""
    lengths_q, lengths_k = torch.tensor([4, 1]), torch.tensor([5, 2])
    full = AttentionMetadata.from_lengths(lengths_q, lengths_k)
    meta = AttentionMetadata(cu_seqlens_q=full.cu_seqlens_q, cu_seqlens_k=full.cu_seqlens_k)
    before = _snapshot(meta)
    for i, (seq_q, seq_k) in enumerate(CALL_SHAPES):
        q, k, v = random_qkv(batch=2, seq_q=seq_q, seq_k=seq_k, seed=10 + i)
        out = impl(q, k, v, meta)
        _assert_unchanged(meta, before, f"call {i}")
        expected = loop_attention(q, k, v, lengths_q, lengths_k)
        assert (out.double() - expected).abs().max().item() <= 1e-5, (seq_q, seq_k)


# -- a whole DiT call ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dit_inputs():
    """A tiny random WanDiT and inputs whose video tokens (12) and text tokens (16) differ in number."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = WanDiT(TINY).eval()
    gen = torch.Generator().manual_seed(4)
    latents = torch.randn(2, 4, 1, 8, 6, generator=gen)  # 1 x 4 x 3 patches of (1, 2, 2): 12 tokens
    text = torch.randn(2, TINY.text_len, TINY.text_dim, generator=gen)
    assert model.token_grid(latents.shape) == (1, 4, 3)
    return model, latents, torch.tensor([900.0, 300.0]), text


def _dit(dit_inputs, impl, metadata: DiTAttention) -> torch.Tensor:
    model, latents, timestep, text = dit_inputs
    with torch.no_grad():
        return model(latents, timestep, text, attention=impl, metadata=metadata)


@pytest.mark.parametrize("text_lens", [None, [16, 5]], ids=["dense-text", "varlen-text"])
@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
def test_dit_call_leaves_every_metadata_field_unchanged(dit_inputs, impl, text_lens):
    lens = None if text_lens is None else torch.tensor(text_lens)
    metadata = WanDiT.build_attention_metadata(lens, text_len=TINY.text_len)
    before = {site: _snapshot(getattr(metadata, site)) for site in ("self_attn", "cross_attn")}
    objects = (metadata.self_attn, metadata.cross_attn)
    _dit(dit_inputs, impl, metadata)
    _dit(dit_inputs, impl, metadata)
    assert (metadata.self_attn, metadata.cross_attn) == objects and all(
        a is b for a, b in zip((metadata.self_attn, metadata.cross_attn), objects, strict=True)
    )
    for site, snapshot in before.items():
        _assert_unchanged(getattr(metadata, site), snapshot, site)


@pytest.mark.parametrize("impl", IMPLS.values(), ids=IMPLS.keys())
def test_dit_with_one_dense_metadata_shared_by_both_sites(dit_inputs, impl):
    """Self-attention (12 video keys) and cross-attention (16 text keys) through one dense object: the
    output of separate objects, and the shared object still all None."""
    shared = AttentionMetadata()
    got = _dit(dit_inputs, impl, DiTAttention(self_attn=shared, cross_attn=shared))
    assert all(value is None for value in _fields(shared).values()), _fields(shared)
    separate = _dit(
        dit_inputs, impl, DiTAttention(self_attn=AttentionMetadata(), cross_attn=AttentionMetadata())
    )
    torch.testing.assert_close(got, separate, atol=1e-6, rtol=1e-6)
    assert separate.abs().max() > 0.1  # a real output, not two near-zero tensors
