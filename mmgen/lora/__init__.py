"""LoRAs: file formats read into one internal form, applied fused or unfused to one or more experts.

Read: `read_lora_file(path)` / `parse_lora(state, metadata)` -> LoRAContents (mmgen.lora.form).
Apply: `apply_loras(experts, [(LoRARequest, LoRAFile), ...], mode=, allow_unmatched=)` -> AppliedLoRAs,
whose `report` says exactly what was applied and whose `remove()` restores the base weights bitwise.
`LoRASlot` keeps the current set for a pipeline so that jobs with the same LoRAs reuse them.
"""

from mmgen.lora.apply import AppliedLoRAs, apply_loras
from mmgen.lora.form import LoRAContents, LoRATarget, LowRank
from mmgen.lora.readers import LoRAFile, parse_lora, read_lora_file
from mmgen.lora.report import LoRAReport
from mmgen.lora.request import LORA_MODES, LoRARequest, coerce_requests
from mmgen.lora.slot import LoRASlot

__all__ = (
    "LORA_MODES",
    "AppliedLoRAs",
    "LoRAContents",
    "LoRAFile",
    "LoRAReport",
    "LoRARequest",
    "LoRASlot",
    "LoRATarget",
    "LowRank",
    "apply_loras",
    "coerce_requests",
    "parse_lora",
    "read_lora_file",
)
