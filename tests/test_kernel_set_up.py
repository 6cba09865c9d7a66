"""mmgen.layers.kernel_set_up: the kernels' one-time set-up begun beside a GPU load, used by the first step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mmgen.layers.kernel_set_up import start_kernel_set_up, triton_set_up

HAS_TRITON = subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode == 0
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(HAS_TRITON, reason="checks the case of a torch without Triton")
def test_without_triton_nothing_is_done_and_nothing_raised():
    assert triton_set_up() is False
    thread = start_kernel_set_up(torch.device("cpu"), torch.float32)
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_cpu_load_begins_no_set_up_and_a_cuda_load_names_its_device_and_dtype(monkeypatch, tmp_path):
    """Every face's loader (mmgen.families.load_pipeline) starts the thread only for a CUDA device (a CPU
    load never imports Triton), for the GPU the load's kernels run on: "cuda:N" as named, "cuda" and a
    rank's load (parallel given) this thread's current device (the new thread's own would be GPU 0),
    with the family's first_kernels but on a world's ranks other than 0."""
    import mmgen.families.registry as registry

    started = []

    def first_kernels(device: torch.device, dtype: torch.dtype) -> None:
        raise AssertionError("only the set-up thread calls it")

    loaded = type(
        "Family",
        (),
        {"load": staticmethod(lambda directory, **kwargs: "pipeline"), "first_kernels": first_kernels},
    )
    monkeypatch.setattr(
        registry,
        "start_kernel_set_up",
        lambda device, dtype, family_kernels: started.append((device, dtype, family_kernels)),
    )
    monkeypatch.setattr(registry, "family_of", lambda directory: loaded)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert registry.load_pipeline(tmp_path, task="t2v", device="cpu", dtype="float32") == "pipeline"
    assert started == []
    assert registry.load_pipeline(tmp_path, task="t2v", device="cuda", dtype="bfloat16") == "pipeline"
    assert registry.load_pipeline(tmp_path, task="t2v", device="cuda:1", dtype="float32") == "pipeline"
    for rank in (0, 1):  # a rank's layout: its device is the one its process set
        layout = SimpleNamespace(rank=rank, world_size=2)
        assert (
            registry.load_pipeline(tmp_path, task="t2v", device="cuda:0", dtype="float16", parallel=layout)
            == "pipeline"
        )
    assert started == [
        (torch.device("cuda", 3), torch.bfloat16, first_kernels),
        (torch.device("cuda", 1), torch.float32, first_kernels),
        # only rank 0 encodes the prompts of a world: the others launch no text encoder's kernels
        (torch.device("cuda", 3), torch.float16, first_kernels),
        (torch.device("cuda", 3), torch.float16, None),
    ]


def test_wan_launches_its_text_encoders_first_kernels_without_drawing_random_numbers():
    """Wan's first_kernels run a tiny UMT5 encoder beside the load: they must not move the global
    generator a seeded request in the main thread may draw from (here on the CPU, where it runs too)."""
    from mmgen.families.builtin import WAN
    from mmgen.models.umt5 import launch_first_kernels

    assert WAN.first_kernels is launch_first_kernels
    state = torch.random.get_rng_state()
    launch_first_kernels(torch.device("cpu"), torch.float32)
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_familys_first_kernels_run_after_the_libraries_on_the_loads_gpu():
    calls = []

    def first_kernels(device: torch.device, dtype: torch.dtype) -> None:
        calls.append((device, dtype, torch.cuda.current_device()))
        from mmgen.models.umt5 import launch_first_kernels

        launch_first_kernels(device, dtype)
        calls.append("launched")  # not reached if it raised (the thread keeps its errors quiet)

    last = torch.device("cuda", torch.cuda.device_count() - 1)
    thread = start_kernel_set_up(last, torch.bfloat16, first_kernels)
    thread.join(timeout=120)
    assert calls == [(last, torch.bfloat16, last.index), "launched"]


# In a fresh interpreter: after the set-up, Triton's cache key is computed once and the first kernel call
# (the fused silu(gate) * up's) finds it cached instead of hashing again, and computes the right values.
FRESH = """
from mmgen.layers.kernel_set_up import triton_set_up
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
    done = subprocess.run(
        [sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


# In a fresh interpreter whose main thread uses the last GPU: the set-up's thread works on that GPU only
# (a new thread's current device is GPU 0: a context made there would hold memory on another rank's GPU).
ONE_DEVICE = """
import ctypes, torch
from mmgen.layers.kernel_set_up import library_set_up, start_kernel_set_up
last = torch.cuda.device_count() - 1
torch.cuda.set_device(last)
thread = start_kernel_set_up(torch.device("cuda", last), torch.bfloat16)
thread.join(timeout=120)
library_set_up(torch.device("cuda", last), torch.float32)  # raises here, if anything does
cuda = ctypes.CDLL("libcuda.so.1")
flags, active = ctypes.c_uint(), ctypes.c_int()
for ordinal in range(last + 1):
    device = ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(device), ordinal) == 0
    assert cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) == 0
    print(ordinal, active.value)
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_the_library_set_up_runs_on_the_named_gpu_only():
    done = subprocess.run(
        [sys.executable, "-c", ONE_DEVICE], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    states = dict(line.split() for line in done.stdout.split("\n") if line.strip())
    last = str(len(states) - 1)
    assert states == {**{ordinal: "0" for ordinal in states}, last: "1"}, states
