"""Pure-torch references of the external attention kernels mmgen calls (CPU path and test oracle).

`flash_attn`: FA3's flash_attn_with_kvcache / get_scheduler_metadata / flash_attn_varlen_func and FA4's
varlen func with page_table + seqused_k, plus provider objects over the real libraries.
`flashinfer`: FlashInfer's ragged / paged prefill and paged decode wrappers and merge_state.
"""

from mmgen.kernels.flash_attn import (
    FA3FlashAttention,
    FA4FlashAttention,
    FlashAttentionProvider,
    KernelContractError,
    KernelUnavailableError,
    ReferenceFlashAttention,
    SchedulerMetadataInfo,
    describe_scheduler_metadata,
    load_flash_attention_provider,
)
from mmgen.kernels.flashinfer import FlashInferLibrary, ReferenceFlashInfer, load_flashinfer_provider

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
    "describe_scheduler_metadata",
    "load_flash_attention_provider",
    "load_flashinfer_provider",
]
