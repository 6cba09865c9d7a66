"""One way from user choices (model, task, device, dtype) to a loaded pipeline.

`mmgen generate`, `mmgen render` and `mmgen ab` all resolve "auto" and load through here, so the
rules (cuda when available; bfloat16 on a GPU, float32 on the CPU; "default" = the embedded model)
exist once.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mmgen.errors import ValidationError

TASKS = ("t2v", "t2i", "i2v")


def resolve_device(name: str) -> str:
    """'auto' -> 'cuda' when available, else 'cpu'; a CUDA device that is not there is an error."""
    import torch

    available = torch.cuda.is_available()
    if name == "auto":
        return "cuda" if available else "cpu"
    if name.startswith("cuda") and not available:
        raise ValidationError(f"device {name!r}: CUDA is not available here; use cpu")
    return name


def resolve_dtype(name: str, device: str) -> str:
    """'auto' -> 'bfloat16' on a GPU, 'float32' on the CPU; other names pass through."""
    if name == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    return name


# dtype names: torch's and their short forms (both spellings are accepted by every face).
DTYPE_NAMES: Mapping[str, str] = MappingProxyType(
    {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
    | {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
)


def check_dtype(value: Any) -> str:
    """'auto' or a dtype (float32 | bfloat16 | float16, fp32 | bf16 | fp16, or the torch dtype) -> its name."""
    # a torch.dtype prints as torch.float32; the short forms are names, never a dtype's repr
    name = value if isinstance(value, str) else str(value).removeprefix("torch.").replace("fp", "-")
    if name == "auto" or name in DTYPE_NAMES:
        return DTYPE_NAMES.get(name, name)
    raise ValidationError(
        f"dtype {value!r}: allowed values are auto, float32, bfloat16, float16 (or fp32, bf16, fp16)"
    )


def load_pipeline(
    model: str | Path | None,
    *,
    task: str,
    device: str,
    dtype: str,
    offload: str | None = None,
    gpu_memory_gb: float | None = None,
    load_on_host: bool | None = None,
    parallel: Any = None,
) -> Any:
    """WanT2VPipeline (task 't2v'), WanT2IPipeline ('t2i') or WanI2VPipeline ('i2v') from a model directory.

    Any Wan variant loads under any task; the pipeline refuses requests the checkpoint cannot serve.

    model None or "default" = the embedded default model (built on first use). device and dtype are
    resolved names (see resolve_device / resolve_dtype), e.g. "cuda", "bfloat16". offload /
    gpu_memory_gb: the pipeline's default memory policy; with one set (or load_on_host) the weights
    load into host memory first (see WanT2VPipeline.from_pretrained).
    parallel: a ParallelLayout / ParallelConfig for from_pretrained (None = one process).
    """
    import torch

    if task not in TASKS:
        raise ValidationError(f"task {task!r}: allowed values are {', '.join(TASKS)}")
    if model is None or model == "default":
        from mmgen.default_model import ensure_default_model

        directory = ensure_default_model()
    else:
        directory = Path(model)
    if task == "t2i":
        from pipelines.wan_t2i import WanT2IPipeline as pipeline_class
    elif task == "i2v":
        from pipelines.wan_i2v import WanI2VPipeline as pipeline_class
    else:
        from pipelines.wan_t2v import WanT2VPipeline as pipeline_class
    return pipeline_class.from_pretrained(
        directory,
        dtype=getattr(torch, dtype),
        device=device,
        offload=offload,
        gpu_memory_gb=gpu_memory_gb,
        load_on_host=load_on_host,
        parallel=parallel,
    )
