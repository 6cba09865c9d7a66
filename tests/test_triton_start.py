"""mmgen.layers.triton_start: Triton's one-time set-up begun beside a GPU load, used by the first kernel call."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmgen.layers.triton_start import start_triton_set_up, triton_set_up

HAS_TRITON = subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode == 0


@pytest.mark.skipif(HAS_TRITON, reason="checks the case of a torch without Triton")
def test_without_triton_nothing_is_done_and_nothing_raised():
    assert triton_set_up() is False
    thread = start_triton_set_up()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_cpu_load_begins_no_set_up(monkeypatch, tmp_path):
    """Every face's loader (mmgen.families.load_pipeline) starts the thread only for a CUDA device (a CPU
    load never imports Triton)."""
    import mmgen.families.registry as registry

    started = []
    loaded = type("Family", (), {"load": staticmethod(lambda directory, **kwargs: "pipeline")})
    monkeypatch.setattr(registry, "start_triton_set_up", lambda: started.append(1))
    monkeypatch.setattr(registry, "family_of", lambda directory: loaded)
    assert registry.load_pipeline(tmp_path, task="t2v", device="cpu", dtype="float32") == "pipeline"
    assert started == []
    assert registry.load_pipeline(tmp_path, task="t2v", device="cuda", dtype="bfloat16") == "pipeline"
    assert started == [1]


# In a fresh interpreter: after the set-up, Triton's cache key is computed once and the first kernel call
# (the fused silu(gate) * up's) finds it cached instead of hashing again, and computes the right values.
FRESH = """
from mmgen.layers.triton_start import triton_set_up
assert triton_set_up()
from triton.runtime.cache import triton_key
assert triton_key.cache_info().currsize == 1 and triton_key.cache_info().hits == 0
import torch
from mmgen.layers.fused_activations import silu_mul
x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
out = silu_mul(x, x)
torch.cuda.synchronize()
assert triton_key.cache_info().hits >= 1, triton_key.cache_info()
assert torch.allclose(out.float(), silu_mul(x, x, kernel=False).float(), atol=1e-2, rtol=1e-2)
print("ok")
"""


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs a CUDA GPU and Triton")
def test_the_first_kernel_call_uses_the_key_computed_early():
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=300, cwd=root
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
