"""Pure-torch references of the external attention kernels mmgen calls (CPU path and test oracle).

`contract`: the kernel errors and the argument checks every reference shares.
`flash_attn`: FA3's flash_attn_with_kvcache / flash_attn_varlen_func (+ FA4's paged varlen form) and
flash_attn_func. `scheduler_metadata`: FA3's get_scheduler_metadata, validated by the kvcache call.
`fa_providers`: provider objects over the references, FA3 and FA4, and load_flash_attention_provider.
`flashinfer`: FlashInfer's ragged / paged prefill and paged decode wrappers.
`flashinfer_providers`: merge_state, provider objects over the references and FlashInfer, load_flashinfer_provider.
"""

from mmgen.kernels.contract import KernelContractError, KernelUnavailableError, gpu_kernels_apply
from mmgen.kernels.fa_providers import (
    FA3FlashAttention,
    FA4FlashAttention,
    FlashAttentionProvider,
    ReferenceFlashAttention,
    VarlenArgs,
    load_flash_attention_provider,
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

__all__ = [
    "FA3FlashAttention",
    "FA4FlashAttention",
    "FlashAttentionProvider",
    "FlashInferLibrary",
    "KernelContractError",
    "KernelUnavailableError",
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
    "load_flash_attention_provider",
    "load_flashinfer_provider",
]
