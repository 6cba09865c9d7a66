"""mmgen.parallel.cuda_context: a started rank's primary CUDA context made before torch is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmgen.parallel.cuda_context import (
    load_nccl_kernels,
    nccl_library,
    retain_primary_context,
    start_primary_context,
)


def test_without_a_driver_nothing_is_made_and_nothing_raised():
    assert retain_primary_context(0, library="libmmgen-no-such-driver.so") is False
    # a library that loads but has no driver functions
    assert retain_primary_context(0, library="libc.so.6") is False
    if not torch.cuda.is_available():
        thread = start_primary_context(0)
        thread.join(timeout=30)
        assert not thread.is_alive()


# In a fresh interpreter: the context made through the driver API before torch is imported is the
# one torch then uses (the device's primary context, active before torch's first call).
FRESH = """
import ctypes, sys
from mmgen.parallel.cuda_context import retain_primary_context
assert retain_primary_context(0)
cuda = ctypes.CDLL("libcuda.so.1")
device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
assert cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) == 0
assert active.value == 1, "the primary context is not active after the retain"
import torch
torch.cuda.set_device(0)
x = torch.arange(6, device="cuda", dtype=torch.float32)
assert (x * 2).sum().item() == 30.0
mine = ctypes.c_void_p()
assert cuda.cuCtxGetCurrent(ctypes.byref(mine)) == 0
primary = ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(primary), device) == 0
assert mine.value == primary.value, "torch runs in another context than the device's primary one"
print("ok")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_context_made_early_is_the_one_torch_uses():
    root = Path(__file__).resolve().parents[1]  # the checkout's mmgen, installed or not
    done = subprocess.run(
        [sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=120, cwd=root
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_one_process_generate_begins_its_gpus_context_for_the_devices_that_name_one():
    """`mmgen generate` without --gpus N begins its CUDA context beside its imports (mmgen.cli
    .early_cuda_context) for auto, cuda and cuda:N, and not for cpu or a name that is no CUDA device
    (the parse then says what is wrong with it)."""
    from mmgen.cli import early_cuda_context

    begun = {name: early_cuda_context(name) for name in ("auto", "cuda", "cuda:1", "cpu", "cuda:x", "mps")}
    assert begun == {"auto": True, "cuda": True, "cuda:1": True, "cpu": False, "cuda:x": False, "mps": False}


def test_nccl_kernels_without_a_library_nothing_is_loaded_and_nothing_raised(tmp_path):
    """No libnccl beside torch (a CPU build), a missing file, a library without NCCL's functions: False."""
    assert nccl_library(site=str(tmp_path)) is None
    assert load_nccl_kernels(0, library=str(tmp_path / "libnccl.so.2")) is False
    assert load_nccl_kernels(0, library="libc.so.6") is False
    found = tmp_path / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    found.parent.mkdir(parents=True)
    found.write_bytes(b"")
    assert nccl_library(site=str(tmp_path)) == str(found)  # pip's nvidia-nccl layout beside torch
    if not torch.cuda.is_available():
        thread = start_primary_context(0, nccl=True)
        thread.join(timeout=30)
        assert not thread.is_alive()


# In a fresh interpreter: NCCL's kernels loaded early through the libnccl found beside torch, then torch's
# own NCCL runs on that same library (one libnccl mapped in the process) and works.
FRESH_NCCL = """
import os, sys
from mmgen.parallel.cuda_context import load_nccl_kernels, nccl_library
library = nccl_library()
assert load_nccl_kernels(0), "NCCL's kernels were not loaded"
import torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1,
                        device_id=torch.device("cuda", 0))
x = torch.ones(4, device="cuda")
dist.all_reduce(x)
assert x.sum().item() == 4.0
mapped = {line.split()[-1] for line in open("/proc/self/maps") if "libnccl" in line}
assert mapped == {os.path.realpath(library)}, mapped
dist.destroy_process_group()
print("ok")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_kernels_loaded_early_are_torchs_own_library():
    if nccl_library() is None:
        pytest.skip("this torch has no libnccl.so.2 of pip's nvidia-nccl beside it")
    from mmgen.parallel.process import free_port

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", FRESH_NCCL, str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_nccl_settings_are_mmgens_where_unset_and_the_users_where_set(monkeypatch):
    """A rank of an NCCL world runs with NCCL_CUMEM_ENABLE=0 (process.NCCL_DEFAULTS) unless the user set it,
    set before NCCL's first call (the early thread's, start_primary_context(..., nccl=True))."""
    from mmgen.parallel.process import NCCL_DEFAULTS, nccl_defaults

    assert NCCL_DEFAULTS == {"NCCL_CUMEM_ENABLE": "0"}
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    start_primary_context(0)  # one GPU's process: no NCCL, nothing set
    assert "NCCL_CUMEM_ENABLE" not in os.environ
    start_primary_context(0, nccl=True).join(timeout=60)
    assert os.environ["NCCL_CUMEM_ENABLE"] == "0"
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")
    nccl_defaults()
    assert os.environ["NCCL_CUMEM_ENABLE"] == "1"
