"""flash_attention backend through the FA3/FA4 kernel references vs the torch_native backend.

Randomized layouts: batch 1-16, page sizes 1 and 16, prefixes 0 and longer than the window, every
request with its own encoder length, GQA 4/2 and 8/2, softcap. Plus one test per known failure:
a batch-wide encoder offset, DRAFT_EXTEND_V2 extents taken from seq_lens alone, scheduler metadata
computed per layer or shared across windows.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from llm_backend_cases import make_case, make_layers, run_layers

from mmgen.kernels import ReferenceFlashAttention, describe_scheduler_metadata
from mmgen.llm.attention_layer import AttentionLayer
from mmgen.llm.backends.flash_attention import FlashAttentionBackend
from mmgen.llm.backends.flash_metadata import compute_flash_metadata
from mmgen.llm.backends.torch_native import TorchNativeBackend
from mmgen.llm.forward_batch import ForwardMode

MODES = [
    ForwardMode.EXTEND,
    ForwardMode.DECODE,
    ForwardMode.MIXED,
    ForwardMode.TARGET_VERIFY,
    ForwardMode.DRAFT_EXTEND_V2,
]
# (mode, batch, page size, q heads, kv heads, softcap): every mode on both page sizes, batch 1..16
LAYOUTS = [
    (mode, bs, ps, hq, hk, cap)
    for i, mode in enumerate(MODES)
    for bs, ps, hq, hk, cap in (
        ((1, 16, 4, 2, 0.0) if i % 2 else (16, 1, 8, 2, 30.0)),
        ((9, 1, 4, 2, 30.0) if i % 2 else (5, 16, 4, 2, 0.0)),
    )
]


def _flash(case, **kw) -> tuple[FlashAttentionBackend, ReferenceFlashAttention]:
    provider = ReferenceFlashAttention()
    return FlashAttentionBackend(case.req_pool, case.kv_pool, case.layers, provider=provider, **kw), provider


@pytest.mark.parametrize("mode,bs,ps,hq,hk,cap", LAYOUTS)
def test_matches_torch_native(mode, bs, ps, hq, hk, cap):
    case = make_case(
        mode, seed=bs * 7 + ps, batch_size=bs, page_size=ps, num_q_heads=hq, num_kv_heads=hk, softcap=cap
    )
    assert len(set(case.encoder_lens)) == bs
    expected = run_layers(TorchNativeBackend(case.req_pool, case.kv_pool), case)
    backend, _ = _flash(case)
    for got, want in zip(run_layers(backend, case), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ps", [1, 16])
def test_page_tables_are_per_row(ps):
    """Row i's decoder pages start at ITS encoder length (a batch-wide encoder_lens[0] offset fails here,
    and in test_matches_torch_native where every request has its own encoder length)."""
    case = make_case(ForwardMode.DECODE, seed=5, batch_size=6, page_size=ps)
    md = compute_flash_metadata(case.batch, case.req_pool.req_to_token, ps)
    table = case.req_pool.req_to_token
    for i, row in enumerate(case.batch.req_pool_indices.tolist()):
        enc, extent = case.encoder_lens[i], case.prefix_lens[i] + 1
        dec_pages = table[row, enc : enc + extent : ps] // ps
        enc_pages = table[row, 0:enc:ps] // ps
        assert md.page_table[i, : len(dec_pages)].tolist() == dec_pages.tolist()
        assert md.encoder_page_table[i, : len(enc_pages)].tolist() == enc_pages.tolist()
    assert md.encoder_lens_int32.tolist() == case.encoder_lens
    assert md.encoder_max_seq_len_k == max(case.encoder_lens)
    assert md.encoder_cu_seqlens_k.tolist() == [0, *torch.tensor(case.encoder_lens).cumsum(0).tolist()]


@pytest.mark.parametrize("ps", [1, 16])
def test_draft_extend_reads_prefix_plus_extend(ps):
    """DRAFT_EXTEND_V2: seq_lens is the prefix; the kernels read seq_lens + extend_seq_lens keys."""
    case = make_case(ForwardMode.DRAFT_EXTEND_V2, seed=21 + ps, batch_size=7, page_size=ps, draft_token_num=4)
    md = compute_flash_metadata(case.batch, case.req_pool.req_to_token, ps)
    extents = [p + q for p, q in zip(case.prefix_lens, case.query_lens, strict=True)]
    assert case.batch.seq_lens_cpu.tolist() == case.prefix_lens
    assert md.cache_seqlens_int32.tolist() == extents
    assert md.max_seq_len_k == max(extents)
    assert md.max_seq_len_k < max(case.prefix_lens) + max(
        case.query_lens
    )  # the case separates the two maxima
    assert md.page_table.shape[1] >= -(-max(extents) // ps)
    assert md.cu_seqlens_k.tolist() == [0, *torch.tensor(extents).cumsum(0).tolist()]
    expected = run_layers(TorchNativeBackend(case.req_pool, case.kv_pool), case)
    backend, _ = _flash(case)
    for got, want in zip(run_layers(backend, case), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _deep_layers(n_layers: int, window: int) -> list[AttentionLayer]:
    """n_layers decoder layers (sliding/global alternating), each a self and a cross site, on buffers 0/1."""
    sliding, cross, full, _ = make_layers(4, 2, 16, window, 20.0)
    layers = []
    for i in range(n_layers):
        layers += [replace(sliding if i % 2 == 0 else full, layer_id=i % 2), replace(cross, layer_id=i % 2)]
    return layers


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_scheduler_metadata_once_per_batch_per_site(mode):
    """get_scheduler_metadata runs in init_forward_metadata once per distinct site, never in a layer."""
    case = make_case(mode, seed=31, batch_size=4, page_size=16, softcap=20.0)
    case.layers = _deep_layers(6, window=8)  # 12 attention calls, 3 distinct sites
    backend, provider = _flash(case)
    backend.init_forward_metadata(case.batch)
    assert provider.calls["get_scheduler_metadata"] == 3
    run_layers(backend, case)  # runs init_forward_metadata again, then all 12 layer calls
    assert provider.calls["get_scheduler_metadata"] == 6
    assert provider.calls["flash_attn_with_kvcache"] == 12


def test_sliding_layers_get_their_own_window_schedule():
    case = make_case(ForwardMode.DECODE, seed=41, batch_size=3, page_size=1, window=8)
    backend, _ = _flash(case)
    backend.init_forward_metadata(case.batch)
    sliding, cross, full, _ = case.layers
    for layer, left, causal in ((sliding, 7, False), (full, -1, True), (cross, -1, False)):
        info = describe_scheduler_metadata(backend.metadata.schedule_for(layer))
        assert (info.window_left, info.causal) == (left, causal)
    enc = describe_scheduler_metadata(backend.metadata.schedule_for(cross)).cache_seqlens
    assert list(enc) == case.encoder_lens


def test_global_schedule_on_a_sliding_layer_is_refused():
    """The reference kernel rejects scheduler metadata of another window (what per-model sharing would do)."""
    case = make_case(ForwardMode.DECODE, seed=43, batch_size=3, page_size=16, window=8)
    backend, provider = _flash(case)
    backend.init_forward_metadata(case.batch)
    sliding, _, full, _ = case.layers
    md = backend.metadata
    shared = md.schedule_for(full)
    hijacked = tuple((site, shared) for site, _ in md.scheduler_metadata)
    backend.metadata = replace(md, scheduler_metadata=hijacked)
    with pytest.raises(ValueError, match="scheduler_metadata was computed for a different call"):
        backend.forward(case.q, case.k, case.v, sliding, case.batch)
