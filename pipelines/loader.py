"""The families' loaders and the rules every load shares (device, dtype, the model directory).

Every face resolves "auto" through here, so the rules (cuda when available; bfloat16 on a GPU,
float32 on the CPU; "default" = the embedded model) exist once; it loads through the family
registry (mmgen.families.load_pipeline), which picks the family's loader below by the directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmgen.default_model import ensure_default_model
from mmgen.errors import ValidationError
from pipelines.checks import image_load_refusals
from pipelines.devices import (  # re-exported: the faces resolve devices and dtypes through the loader
    DTYPE_NAMES,
    check_device,
    check_dtype,
    resolve_device,
    resolve_dtype,
)

__all__ = (
    "DTYPE_NAMES",
    "MODEL_LAYOUTS",
    "TASKS",
    "check_device",
    "check_dtype",
    "load_qwen_image_pipeline",
    "load_wan_pipeline",
    "model_directory",
    "resolve_device",
    "resolve_dtype",
)

TASKS = ("t2v", "t2i", "i2v")
# What a model directory is (the family registry, mmgen.families, names each family's classes and layouts).
MODEL_LAYOUTS = (
    "a diffusers-format directory with model_index.json, or a model family's original release layout"
)


def model_directory(model: str | Path | None) -> Path:
    """The directory of `model`: None or "default" = the embedded default model (built on first use)."""
    if model is None or model == "default":
        return ensure_default_model()
    if Path(model).is_file():
        raise ValidationError(f"model {str(model)!r} is a file; expected a model directory ({MODEL_LAYOUTS})")
    return Path(model)


def load_qwen_image_pipeline(
    directory: Path,
    *,
    task: str,
    device: str,
    dtype: str,
    offload: str | None = None,
    gpu_memory_gb: float | None = None,
    load_on_host: bool | None = None,
    parallel: Any = None,
) -> Any:
    """The Qwen-Image family's loader: QwenImagePipeline from a Qwen-Image directory (model_index.json
    _class_name QwenImagePipeline), or QwenImageEditPipeline from a Qwen-Image-Edit one (_class_name
    QwenImageEditPipeline).

    It makes images (task 't2i') in one process; offload ('model' / 'layer') is chosen here, at load.
    A GPU budget or a parallel layout is refused before any weight loads (one line each).
    """
    # the family's modules, imported when one of its directories loads (not on every start)
    from mmgen.loading.qwen_image_classes import EDIT_PIPELINE_CLASS
    from mmgen.loading.qwen_image_dir import qwen_pipeline_class
    from pipelines.qwen_image import QwenImagePipeline
    from pipelines.qwen_image_edit import QwenImageEditPipeline

    refused = image_load_refusals("Qwen-Image", directory, task, gpu_memory_gb, load_on_host)
    if parallel is not None and getattr(parallel, "world_size", 1) > 1:
        refused.append(
            "parallel: the Qwen-Image pipeline runs in one process (no sequence or CFG parallel yet)"
        )
    if refused:
        raise ValidationError("; ".join(refused))
    edit = qwen_pipeline_class(directory) == EDIT_PIPELINE_CLASS
    pipeline_class = QwenImageEditPipeline if edit else QwenImagePipeline
    return pipeline_class.from_pretrained(directory, dtype=check_dtype(dtype), device=device, offload=offload)


def load_wan_pipeline(
    directory: Path,
    *,
    task: str,
    device: str,
    dtype: str,
    offload: str | None = None,
    gpu_memory_gb: float | None = None,
    load_on_host: bool | None = None,
    parallel: Any = None,
) -> Any:
    """The Wan family's loader: WanT2VPipeline (task 't2v'), WanT2IPipeline ('t2i') or WanI2VPipeline
    ('i2v') from a Wan directory (diffusers or original layout; see mmgen.families.load_pipeline).

    Any Wan variant loads under any task; the pipeline refuses requests the checkpoint cannot serve.
    offload / gpu_memory_gb: the pipeline's default memory policy; with one set (or load_on_host) the
    weights load into host memory first (see WanT2VPipeline.from_pretrained).
    """
    # the task's pipeline module, imported when it loads (a text-to-video run imports no I2V code)
    if task == "t2i":
        from pipelines.wan_t2i import WanT2IPipeline as pipeline_class
    elif task == "i2v":
        from pipelines.wan_i2v import WanI2VPipeline as pipeline_class
    else:
        from pipelines.wan_t2v import WanT2VPipeline as pipeline_class

    return pipeline_class.from_pretrained(
        directory,
        dtype=check_dtype(dtype),
        device=device,
        offload=offload,
        gpu_memory_gb=gpu_memory_gb,
        load_on_host=load_on_host,
        parallel=parallel,
    )
