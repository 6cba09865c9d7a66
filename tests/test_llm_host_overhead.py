"""Host cost of a decode step: what the fast backends' metadata asks of the device, and graph refusals.

The metadata of a step must never read a value back from the device (on CUDA each read is a sync
that stalls the host until the GPU queue drains). Checked by running it with every device tensor on
the meta device, which has no data: any read back fails there. Host arrays go to the device in one
copy, and FlashInfer's plan gets its indptr arrays as host tensors (it reads them on the host).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from llm_backend_cases import make_case, tiny_t5gemma
from torch.utils._python_dispatch import TorchDispatchMode

from mmgen.errors import MmgenError
from mmgen.kernels import ReferenceFlashAttention, ReferenceFlashInfer
from mmgen.llm.backends.flash_attention import FlashAttentionBackend
from mmgen.llm.backends.flash_metadata import FlashStaticBuffers, compute_flash_metadata
from mmgen.llm.backends.flashinfer import FlashInferBackend
from mmgen.llm.backends.flashinfer_metadata import compute_flashinfer_metadata
from mmgen.llm.cuda_graph_runner import CudaGraphRunner
from mmgen.llm.forward_batch import ForwardMode
from mmgen.llm.memory import KVPool, ReqToTokenPool
from mmgen.llm.speculative import ModelSession

META = torch.device("meta")
MODES = [
    ForwardMode.DECODE,
    ForwardMode.EXTEND,
    ForwardMode.MIXED,
    ForwardMode.TARGET_VERIFY,
    ForwardMode.DRAFT_EXTEND_V2,
]


class HostToDevice(TorchDispatchMode):
    """Counts host->meta copies (the uploads of a step run on the meta device), and the blocking ones
    (non_blocking=False: on CUDA those wait for the GPU queue to drain)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = self.blocking = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if name in ("aten::to", "aten::_to_copy", "aten::copy_") and isinstance(out, torch.Tensor):
            src = args[1] if name == "aten::copy_" else args[0]
            if src.device.type == "cpu" and out.device.type == "meta":
                self.copies += 1
                flag = (
                    args[2] if name == "aten::copy_" and len(args) > 2 else kwargs.get("non_blocking", False)
                )
                self.blocking += not flag
        return out


def _on_meta(case):
    """case's batch and req_to_token with every device tensor moved to the meta device."""
    b = case.batch
    moved = {
        name: getattr(b, name).to(META)
        for name in (
            "req_pool_indices",
            "seq_lens",
            "out_cache_loc",
            "positions",
            "extend_seq_lens",
            "extend_prefix_lens",
            "encoder_lens",
        )  # fmt: skip
        if getattr(b, name) is not None
    }
    return replace(b, **moved), case.req_pool.req_to_token.to(META)


@pytest.mark.parametrize("mode", MODES)
def test_flash_metadata_reads_nothing_back(mode):
    case = make_case(mode, seed=3, batch_size=5, page_size=16)
    batch, req_to_token = _on_meta(case)
    with torch.inference_mode(), HostToDevice() as h2d:
        meta = compute_flash_metadata(batch, req_to_token, 16)
    assert (h2d.copies, h2d.blocking) == (1, 0)  # every host array of the step in one non-blocking upload
    assert meta.page_table.device == META and meta.encoder_lens_int32.device == META
    # Replay: the same computation at the static width, loaded with device copies only.
    static = FlashStaticBuffers(8, 16, META)
    with torch.inference_mode(), HostToDevice() as h2d:
        loaded = static.load(compute_flash_metadata(batch, req_to_token, 16, page_table_width=16))
    assert (h2d.copies, h2d.blocking) == (1, 0)
    assert loaded.page_table.data_ptr() == static.tables.data_ptr()


@pytest.mark.parametrize("mode", MODES)
def test_flashinfer_metadata_reads_nothing_back(mode):
    case = make_case(mode, seed=4, batch_size=5, page_size=16, window=6)
    batch, req_to_token = _on_meta(case)
    with torch.inference_mode(), HostToDevice() as h2d:
        meta = compute_flashinfer_metadata(batch, req_to_token, 16, 5)
    masks = int(meta.sliding.custom_mask is not None)
    assert (h2d.copies, h2d.blocking) == (1 + masks, 0)  # the page runs of every call in one upload (+ mask)
    # What plan() reads on the host stays on the host; what the kernels read is on the device.
    assert meta.qo_indptr.device.type == "cpu"
    for layout in (meta.full.paged, meta.sliding.paged, meta.cross):
        if layout is not None:
            assert (layout.indptr.device.type, layout.last_page_len.device.type) == ("cpu", "cpu")
            assert layout.indices.device == META


class _PlanRecorder:
    """A FlashInfer wrapper that records the devices of its plan() tensors and runs nothing."""

    def __init__(self, *args, log: list, **kwargs) -> None:
        self.log = log

    def plan(self, *args, **kwargs) -> None:
        tensors = [*args, kwargs.get("custom_mask")]
        self.log.append(tuple(a.device.type for a in tensors if isinstance(a, torch.Tensor)))


class _Unscheduled(ReferenceFlashAttention):
    """FA4-like: no scheduler metadata (the reference's own reads the lengths back, which meta cannot)."""

    def _scheduler_metadata(self, *args, **kwargs) -> None:
        return None


class _RecordingFlashInfer:
    name = "recorder"

    def __init__(self) -> None:
        self.log: list = []

    def _wrapper(self, *args, **kwargs):
        return _PlanRecorder(*args, log=self.log, **kwargs)

    BatchDecodeWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper = _wrapper
    BatchPrefillWithRaggedKVCacheWrapper = _wrapper


@pytest.mark.parametrize("backend_name", ["flash_attention", "flashinfer"])
def test_graph_replay_preparation_reads_nothing_back(backend_name):
    """The runner's whole host step before a replay (static inputs, metadata, loads, plans) on meta."""
    case = make_case(ForwardMode.DECODE, seed=5, batch_size=3, page_size=16)
    batch, _ = _on_meta(case)
    req_pool = ReqToTokenPool(case.req_pool.req_to_token.shape[0], case.req_pool.req_to_token.shape[1], META)
    kv_pool = KVPool(2, 64, 16, 2, 16, torch.float32, META)
    if backend_name == "flash_attention":
        backend = FlashAttentionBackend(req_pool, kv_pool, case.layers, provider=_Unscheduled())  # fmt: skip
    else:
        provider = _RecordingFlashInfer()
        backend = FlashInferBackend(req_pool, kv_pool, case.layers, provider=provider, workspace_bytes=64)
    runner = CudaGraphRunner(torch.nn.Module(), backend, batch_sizes=(4,), use_cuda_graph=False)
    runner.capture()
    ids = torch.zeros(3, dtype=torch.int64, device=META)
    with torch.inference_mode(), HostToDevice() as h2d:
        runner.prepare(batch, ids)
    assert (h2d.copies, h2d.blocking) == (1, 0)
    if (
        backend_name == "flashinfer"
    ):  # decode plans: indptr and last_page_len on the host, indices on the device
        assert provider.log[-3:] == [("cpu", "meta", "cpu")] * 3


@pytest.mark.parametrize("backend", ["flash_attention", "flashinfer"])
def test_runner_refuses_to_capture_the_reference_kernels(backend):
    """The references read lengths back to the host, which a CUDA-graph capture cannot do: the runner
    refuses before capturing, naming the provider and what to install."""
    model = tiny_t5gemma(seed=3)
    provider = ReferenceFlashAttention() if backend == "flash_attention" else ReferenceFlashInfer()
    session = ModelSession(
        model, backend=backend, page_size=16, max_context=64, max_kv_tokens=512, backend_options={"provider": provider}
    )  # fmt: skip
    install = "flash-attn-4 or fa3" if backend == "flash_attention" else "flashinfer-python"
    with pytest.raises(
        MmgenError, match=f"reference provider cannot be captured in a CUDA graph.*install {install}"
    ):
        CudaGraphRunner(model, session.backend, batch_sizes=(1, 2), use_cuda_graph=True)
    CudaGraphRunner(
        model, session.backend, batch_sizes=(1, 2), use_cuda_graph=False
    ).capture()  # eager path ok


def test_flashinfer_masked_prefix_plan_gets_device_offsets():
    """FlashInfer packs a custom mask on the device with offsets it derives from qo_indptr, indptr and
    last_page_len: the masked (sliding, cached prefix) plan gets those on the device, the others on the host."""
    case = make_case(ForwardMode.EXTEND, seed=6, batch_size=3, page_size=16, window=6)
    batch, _ = _on_meta(case)
    req_pool = ReqToTokenPool(case.req_pool.req_to_token.shape[0], case.req_pool.req_to_token.shape[1], META)
    kv_pool = KVPool(2, 64, 16, 2, 16, torch.float32, META)
    provider = _RecordingFlashInfer()
    backend = FlashInferBackend(req_pool, kv_pool, case.layers, provider=provider, workspace_bytes=64)
    with torch.inference_mode():
        backend.init_forward_metadata(batch)
    # Plan order: full ragged + paged prefix, sliding ragged + masked paged prefix, cross paged.
    assert provider.log == [
        ("cpu", "cpu"),
        ("cpu", "cpu", "meta", "cpu"),
        ("cpu", "cpu"),
        ("meta", "meta", "meta", "meta", "meta"),  # qo_indptr, indptr, indices, last_page_len, custom_mask
        ("cpu", "cpu", "meta", "cpu"),
    ]
