"""Checks every fast LLM backend must pass the same way (flash_attention and flashinfer, through the
kernel references): random batch layouts against torch_native, and an IDLE step that runs no kernel."""

from __future__ import annotations

import pytest
import torch
from llm_backend_cases import idle_batch, make_case, random_layout, run_layers
from test_llm_backends_flash import _flash
from test_llm_backends_flashinfer import _flashinfer

from mmgen.llm.backends.torch_native import TorchNativeBackend
from mmgen.llm.forward_batch import ForwardMode

FACTORIES = {"flash_attention": _flash, "flashinfer": _flashinfer}


@pytest.mark.parametrize("backend_name", sorted(FACTORIES))
@pytest.mark.parametrize("seed", range(100, 108))
def test_random_layouts_match_torch_native(backend_name, seed):
    case = make_case(**random_layout(seed))
    expected = run_layers(TorchNativeBackend(case.req_pool, case.kv_pool), case)
    backend, _ = FACTORIES[backend_name](case)
    for got, want in zip(run_layers(backend, case), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend_name", sorted(FACTORIES))
def test_idle_step_runs_no_kernel(backend_name):
    case = make_case(ForwardMode.DECODE, seed=3, batch_size=2, page_size=16)
    backend, provider = FACTORIES[backend_name](case)
    backend.init_forward_metadata(idle_batch())
    for layer in case.layers:
        kv = (None, None) if layer.is_cross_attention else (case.k[:0], case.v[:0])
        out = backend.forward(
            case.q[:0], *kv, layer, idle_batch(), save_kv_cache=not layer.is_cross_attention
        )
        assert out.shape == (0, layer.num_q_heads, layer.head_dim)
    assert sum(provider.calls.values()) == 0
