"""One way from user choices (model, task, device, dtype) to a loaded pipeline.

`mmgen generate`, `mmgen render` and `mmgen ab` all resolve "auto" and load through here, so the
rules (cuda when available; bfloat16 on a GPU, float32 on the CPU; "default" = the embedded model)
exist once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmgen.dtypes import DTYPE_NAMES, check_dtype
from mmgen.errors import ValidationError

TASKS = ("t2v", "t2i", "i2v")
MODEL_LAYOUTS = "a diffusers-format directory with model_index.json, or the original Wan2.2 A14B layout"


def resolve_device(name: str) -> str:
    """'auto' -> 'cuda' when available, else 'cpu'; a CUDA device that is not there is an error."""
    import torch

    available = torch.cuda.is_available()
    if name == "auto":
        return "cuda" if available else "cpu"
    if name.startswith("cuda") and not available:
        raise ValidationError(f"device {name!r}: CUDA is not available here; use cpu")
    return name


def check_device(device: Any) -> str:
    """A device name or torch.device the weights can go to ('auto' resolves); a CUDA device that is
    not here, or a name torch does not know, is one line."""
    import torch

    if not isinstance(device, (str, torch.device)):
        raise ValidationError(f"device {device!r}: expected a name such as cpu, cuda, cuda:1 or auto")
    name = str(device)
    if name == "auto":
        return resolve_device(name)
    try:
        parsed = torch.device(name)
    except RuntimeError:
        raise ValidationError(f"device {name!r}: not a device; expected cpu, cuda, cuda:N or auto") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValidationError(f"device {name!r}: CUDA is not available here; use cpu")
        if parsed.index is not None and parsed.index >= count:
            raise ValidationError(f"device {name!r}: this machine shows {count} CUDA device(s)")
    return name


def resolve_dtype(name: str, device: str) -> str:
    """'auto' -> 'bfloat16' on a GPU, 'float32' on the CPU; fp32/bf16/fp16 -> torch's names; others pass."""
    if name == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    return DTYPE_NAMES.get(name, name)  # fp16 -> float16: one name per dtype in plans and A/B checks


def model_directory(model: str | Path | None) -> Path:
    """The directory of `model`: None or "default" = the embedded default model (built on first use)."""
    if model is None or model == "default":
        from mmgen.default_model import ensure_default_model

        return ensure_default_model()
    if Path(model).is_file():
        raise ValidationError(f"model {str(model)!r} is a file; expected a model directory ({MODEL_LAYOUTS})")
    return Path(model)


def check_parallel_model(model: str | Path | None, config: Any) -> None:
    """Before any worker spawns or loads: the model's head count (its transformer's config.json) must
    split over config's Ulysses degree (a ParallelConfig; see mmgen.parallel.launch.check_model_heads)."""
    from mmgen.parallel.launch import check_model_heads

    if config.ulysses > 1:
        check_model_heads(config, model_directory(model))


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
    if task not in TASKS:
        raise ValidationError(f"task {task!r}: allowed values are {', '.join(TASKS)}")
    directory = model_directory(model)
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
