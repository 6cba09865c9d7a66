"""mmgen's own families: Wan (T2V, I2V, TI2V, Wan2.2 A14B, VACE; T2I is Wan at one frame) and
Qwen-Image (T2I, Edit), Qwen-Image-2.1 (T2I, edit with a condition image). One `Family` each: adding a family here is one entry in BUILTIN (a family
outside this repository declares itself by an entry point instead, see mmgen.families.registry).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmgen.families.family import Family
from mmgen.loading import diffusers_dir, qwen_image_classes
from mmgen.loading.original_dir import is_original_a14b, is_original_wan21
from mmgen.loading.wan_transformer import wan_heads
from mmgen.models.umt5 import launch_first_kernels
from pipelines.capabilities import Capabilities
from pipelines.loader import load_qwen_image_pipeline, load_wan_pipeline
from pipelines.qwen_image21_capabilities import CAPABILITIES as QWEN_IMAGE21_CAPABILITIES
from pipelines.qwen_image21_capabilities import PIPELINE_CLASS as QWEN_IMAGE21_CLASS


def is_original_wan(directory: Path) -> bool:
    """The original Wan release layouts mmgen reads (mmgen.loading.original_dir)."""
    return is_original_a14b(directory) or is_original_wan21(directory)


def load_qwen_image21(directory: Path, **settings: Any) -> Any:
    """Qwen-Image-2.1's loader (pipelines.qwen_image21_family), its modules imported when a 2.1
    directory loads: a Wan run never imports them."""
    from pipelines.qwen_image21_family import load_qwen_image21_pipeline

    return load_qwen_image21_pipeline(directory, **settings)


def qwen_image21_heads(directory: Path) -> int:
    """Qwen-Image-2.1's attention heads, read from its config (mmgen.loading.qwen_image21, imported
    when asked: a Wan run never imports it)."""
    from mmgen.loading.qwen_image21 import qwen_image21_heads as read_heads

    return read_heads(directory)


WAN = Family(
    name="wan",
    title="Wan",
    capabilities=Capabilities.every_feature("video", ("t2v", "i2v", "ti2v", "t2i", "vace")),
    pipeline_classes=diffusers_dir.PIPELINE_CLASSES,
    load=load_wan_pipeline,
    original_layout=is_original_wan,
    original_layouts="the original Wan layout (Wan2.2 A14B; Wan2.1 T2V or VACE)",
    heads=wan_heads,
    first_kernels=launch_first_kernels,
)
QWEN_IMAGE = Family(
    name="qwen-image",
    title="Qwen-Image",
    capabilities=Capabilities("image", ("t2i", "edit")),
    pipeline_classes=qwen_image_classes.PIPELINE_CLASSES,
    load=load_qwen_image_pipeline,
)
QWEN_IMAGE21 = Family(
    name="qwen-image-2.1",
    title="Qwen-Image-2.1",
    capabilities=QWEN_IMAGE21_CAPABILITIES,
    pipeline_classes=(QWEN_IMAGE21_CLASS,),
    load=load_qwen_image21,
    heads=qwen_image21_heads,
    ring=False,  # its segment attention runs Ulysses only (mmgen.parallel.packed_rows)
)
BUILTIN = (WAN, QWEN_IMAGE, QWEN_IMAGE21)
