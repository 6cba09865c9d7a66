"""flashinfer backend through the FlashInfer wrapper references vs the torch_native backend.

Randomized layouts as for flash_attention (batch 1-16, page sizes 1 and 16, prefixes 0 and longer than
the window, every encoder length different, GQA, softcap), and the sliding-window extend case: the
ragged call over new tokens and the paged call over the cached prefix both carry window_left, the
prefix is trimmed to what the window reaches, and a custom mask keeps each query inside its window.
"""

from __future__ import annotations

import pytest
import torch
from llm_backend_cases import make_case, run_layers
from test_llm_backends_flash import LAYOUTS

from mmgen.kernels import ReferenceFlashInfer
from mmgen.llm.backends.flashinfer import FlashInferBackend
from mmgen.llm.backends.flashinfer_metadata import compute_flashinfer_metadata
from mmgen.llm.backends.torch_native import TorchNativeBackend
from mmgen.llm.forward_batch import ForwardMode


def _flashinfer(case) -> tuple[FlashInferBackend, ReferenceFlashInfer]:
    provider = ReferenceFlashInfer()
    backend = FlashInferBackend(
        case.req_pool, case.kv_pool, case.layers, provider=provider, workspace_bytes=64
    )
    return backend, provider


def _check_against_torch_native(case) -> FlashInferBackend:
    expected = run_layers(TorchNativeBackend(case.req_pool, case.kv_pool), case)
    backend, _ = _flashinfer(case)
    for got, want in zip(run_layers(backend, case), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    return backend


@pytest.mark.parametrize("mode,bs,ps,hq,hk,cap", LAYOUTS)
def test_matches_torch_native(mode, bs, ps, hq, hk, cap):
    case = make_case(
        mode, seed=bs * 5 + ps, batch_size=bs, page_size=ps, num_q_heads=hq, num_kv_heads=hk, softcap=cap
    )
    assert len(set(case.encoder_lens)) == bs
    _check_against_torch_native(case)


@pytest.mark.parametrize("ps", [1, 16])
def test_sliding_extend_with_long_prefix(ps):
    """Extends longer than the window after prefixes longer than the window: every sliding call is windowed."""
    case = make_case(ForwardMode.EXTEND, seed=60 + ps, batch_size=6, page_size=ps, window=5)
    assert max(case.query_lens) > 5 and max(case.prefix_lens) > 5
    backend = _check_against_torch_native(case)
    sliding = backend.eager["sliding"]
    assert sliding.ragged.plan_info.window_left == 4
    assert sliding.paged.plan_info.window_left == 4
    assert sliding.paged.plan_info.mask_indptr is not None  # planned with the custom mask
    assert backend.eager["full"].ragged.plan_info.window_left == -1
    assert backend.eager["full"].paged.plan_info.window_left == -1
    assert backend.eager["cross"].paged.plan_info.window_left == -1


@pytest.mark.parametrize("ps", [1, 16])
def test_sliding_decode_plans_window(ps):
    case = make_case(ForwardMode.DECODE, seed=70 + ps, batch_size=5, page_size=ps, window=6)
    backend = _check_against_torch_native(case)
    assert backend.eager["sliding"].decode.plan_info.window_left == 5
    assert backend.eager["full"].decode.plan_info.window_left == -1


@pytest.mark.parametrize("ps", [1, 16])
def test_prefix_trimmed_to_window_and_masked(ps):
    """The sliding set reads each prefix from the page holding the first key the window reaches."""
    w = 6
    case = make_case(ForwardMode.EXTEND, seed=80 + ps, batch_size=6, page_size=ps, window=w)
    md = compute_flashinfer_metadata(case.batch, case.req_pool.req_to_token, ps, w - 1)
    prefix = [p for p in case.prefix_lens]
    starts = md.sliding.paged.kv_start.tolist()
    lens = md.sliding.paged.kv_lens.tolist()
    for p, start, n in zip(prefix, starts, lens, strict=True):
        first_needed = max(0, p - (w - 1))  # the first new token sees keys >= its position - window_left
        assert start == first_needed // ps * ps
        assert start + n == p
    assert md.full.paged.kv_start.tolist() == [0] * len(prefix)
    assert md.full.paged.kv_lens.tolist() == prefix
    # The mask is needed: some query of a long extend must not see the start of the trimmed prefix.
    assert md.sliding.custom_mask is not None and not bool(md.sliding.custom_mask.all())
    assert md.sliding.custom_mask.numel() == sum(q * n for q, n in zip(case.query_lens, lens, strict=True))


def test_decode_keys_trimmed_to_window():
    w, ps = 6, 16
    case = make_case(ForwardMode.DECODE, seed=90, batch_size=4, page_size=ps, window=w)
    md = compute_flashinfer_metadata(case.batch, case.req_pool.req_to_token, ps, w - 1)
    for p, start, n in zip(
        case.prefix_lens, md.sliding.paged.kv_start.tolist(), md.sliding.paged.kv_lens.tolist(), strict=True
    ):
        extent = p + 1
        assert start == max(0, extent - w) // ps * ps and start + n == extent


def test_wrapper_plans_once_per_step():
    """Every wrapper is planned in init_forward_metadata, once per step; layers only run."""
    case = make_case(ForwardMode.EXTEND, seed=95, batch_size=3, page_size=16)
    backend, provider = _flashinfer(case)
    backend.init_forward_metadata(case.batch)
    plans = {k: v for k, v in provider.calls.items() if k.endswith(".plan")}
    for layer in case.layers:
        if layer.is_cross_attention:
            backend.forward(case.q, None, None, layer, case.batch, save_kv_cache=False)
        else:
            backend.forward(case.q, case.k, case.v, layer, case.batch)
    assert {k: v for k, v in provider.calls.items() if k.endswith(".plan")} == plans
    assert plans["BatchPrefillWithRaggedKVCacheWrapper.plan"] == 2  # sliding + full
    assert plans["BatchPrefillWithPagedKVCacheWrapper.plan"] == 3  # sliding + full prefix, cross


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_cross_attention_without_encoder_lens_is_a_clear_error(mode):
    """A decoder-only batch has no encoder slots: a cross layer must say so, not call an unplanned wrapper."""
    import dataclasses

    from mmgen.errors import MmgenError

    case = make_case(mode, seed=5, batch_size=3, page_size=16)
    batch = dataclasses.replace(case.batch, encoder_lens=None, encoder_lens_cpu=None)
    backend, _ = _flashinfer(case)
    backend.init_forward_metadata(batch)
    cross = next(layer for layer in case.layers if layer.is_cross_attention)
    with pytest.raises(MmgenError, match="cross-attention in a batch without encoder_lens"):
        backend.forward(case.q, None, None, cross, batch, save_kv_cache=False)
