"""The external attention kernels mmgen calls: pure-torch references of their contracts (the CPU path and
the test oracle) and the adapters over the real libraries (FA3, FA4, FA2, FlashInfer), one interface each.

References: `flash_attn`: FA3's flash_attn_with_kvcache / flash_attn_varlen_func (+ FA4's paged varlen
form) and flash_attn_func. `scheduler_metadata`: FA3's get_scheduler_metadata, validated by the kvcache
call. `flashinfer` (+ `flashinfer_wrapper`, their shared machinery): FlashInfer's ragged / paged
prefill and paged decode wrappers.
Adapters and their availability probing: `fa_providers`: the FlashAttention provider layer (reference,
FA3, FA4, FA2 behind one set of methods; probe_provider, installed_gpu_providers,
load_flash_attention_provider): every FlashAttention call in mmgen goes through it.
`flashinfer_providers`: merge_state, the FlashInfer providers (reference, the flashinfer package),
load_flashinfer_provider.
Shared pieces: `contract`: the kernel errors and argument checks; `varlen`: padded [B, S, H, D] rows
with per-row key lengths <-> packed varlen tensors + cu_seqlens (pack_padded_rows).
"""

from mmgen.kernels.contract import KernelContractError, KernelUnavailableError, gpu_kernels_apply
from mmgen.kernels.fa_providers import (
    FA2FlashAttention,
    FA3FlashAttention,
    FA4FlashAttention,
    FlashAttentionProvider,
    ReferenceFlashAttention,
    VarlenArgs,
    installed_gpu_providers,
    load_flash_attention_provider,
    probe_provider,
)
from mmgen.kernels.flash_attn import (
    attend_one,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    gather_paged,
)
from mmgen.kernels.flashinfer_providers import (
    FlashInferLibrary,
    ReferenceFlashInfer,
    load_flashinfer_provider,
)
from mmgen.kernels.scheduler_metadata import (
    SchedulerMetadataInfo,
    describe_scheduler_metadata,
    get_scheduler_metadata,
)
from mmgen.kernels.varlen import PackedRows, pack_padded_rows

__all__ = [
    "FA2FlashAttention",
    "FA3FlashAttention",
    "FA4FlashAttention",
    "FlashAttentionProvider",
    "FlashInferLibrary",
    "KernelContractError",
    "KernelUnavailableError",
    "PackedRows",
    "ReferenceFlashAttention",
    "ReferenceFlashInfer",
    "SchedulerMetadataInfo",
    "VarlenArgs",
    "attend_one",
    "describe_scheduler_metadata",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "gather_paged",
    "get_scheduler_metadata",
    "gpu_kernels_apply",
    "installed_gpu_providers",
    "load_flash_attention_provider",
    "load_flashinfer_provider",
    "pack_padded_rows",
    "probe_provider",
]
