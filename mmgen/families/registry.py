"""The family registry: which family a model directory is, and its pipeline loaded through that family.

The registry is built when asked (`families()`), never filled at import time: mmgen's own families
(mmgen.families.builtin.BUILTIN), then every family an installed package declares as an entry point
in the group `mmgen.families` (importlib.metadata), so a family package registers itself by being
installed. In its pyproject.toml:

    [project.entry-points."mmgen.families"]
    my-family = "my_package.family:FAMILY"     # a mmgen.families.Family, its name "my-family"

A directory is recognised by its model_index.json `_class_name` (the diffusers layout), else by a
family's original-layout check; one that no family reads is refused with every supported class and
layout named.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

import torch

from mmgen.errors import LoadError, ValidationError
from mmgen.families.builtin import BUILTIN
from mmgen.families.family import Family
from mmgen.layers.kernel_set_up import start_kernel_set_up
from mmgen.loading.safetensors_dir import read_json
from mmgen.placement.upload import calling_thread_gpu
from pipelines.loader import TASKS, model_directory

GROUP = "mmgen.families"  # the entry-point group families outside this repository declare themselves in
MODEL_INDEX = "model_index.json"


def families() -> tuple[Family, ...]:
    """Every family: mmgen's own, then the installed packages' (entry points of GROUP), read now.

    A broken declaration (an import error, not a Family, its name not the entry point's, a name
    taken twice) is a LoadError naming the entry point: it is never skipped in silence."""
    found = list(BUILTIN)
    for entry in entry_points(group=GROUP):
        family = _load_entry(entry)
        taken = [f.name for f in found]
        if family.name in taken:
            raise LoadError(
                f"{_where(entry)}: family name {family.name!r} is taken (families: {', '.join(taken)})"
            )
        found.append(family)
    return tuple(found)


def _load_entry(entry: EntryPoint) -> Family:
    try:
        family = entry.load()
    except Exception as err:  # a plugin's import error: name the entry point that failed
        raise LoadError(f"{_where(entry)}: cannot load ({type(err).__name__}: {err})") from err
    if not isinstance(family, Family):
        raise LoadError(f"{_where(entry)}: {type(family).__name__} is not a mmgen.families.Family")
    if family.name != entry.name:
        raise LoadError(f"{_where(entry)}: the family is named {family.name!r}; name the entry point so")
    return family


def _where(entry: EntryPoint) -> str:
    dist = getattr(entry, "dist", None)
    return f"entry point {entry.name} = {entry.value} ({GROUP}{f', {dist.name}' if dist else ''})"


def detect(directory: str | Path) -> Family | None:
    """The family that reads `directory`, or None (not a directory, or no family's)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    try:
        class_name = _class_name(directory)
    except LoadError:  # model_index.json is not JSON: no family reads it (family_of says why)
        return None
    return next((f for f in families() if f.reads(directory, class_name)), None)


def family_of(directory: str | Path) -> Family:
    """The family that reads `directory`; a LoadError naming what it holds and every supported
    pipeline class and original layout when none does."""
    directory = Path(directory)
    if not directory.is_dir():
        raise LoadError(f"{directory}: model directory not found")
    family = detect(directory)
    if family is not None:
        return family
    known = families()
    classes = ", ".join(name for f in known for name in f.pipeline_classes)
    class_name = _class_name(directory)
    if class_name is not None:
        raise LoadError(f"{directory / MODEL_INDEX}: _class_name is {class_name!r}; supported: {classes}")
    layouts = "".join(f" or {f.original_layouts}" for f in known if f.original_layouts)
    raise LoadError(
        f"{directory}: no {MODEL_INDEX} and no original layout mmgen reads; supported: a diffusers-format "
        f"directory ({classes}){layouts}"
    )


def _class_name(directory: Path) -> str | None:
    """model_index.json's `_class_name` ('' when it names none); None without a model_index.json."""
    path = directory / MODEL_INDEX
    if not path.exists():
        return None
    name = read_json(path).get("_class_name")  # a LoadError naming the file when it is not a JSON object
    return name if isinstance(name, str) else ""


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
    """The pipeline of `model`, loaded by its family (family_of): every face loads through here.

    model None or "default" = the embedded default model (built on first use). task 't2v', 't2i' or
    'i2v' (for Wan: WanT2VPipeline, WanT2IPipeline, WanI2VPipeline; a family refuses a task it has
    not). device and dtype are resolved names (pipelines.loader.resolve_device / resolve_dtype), e.g.
    "cuda", "bfloat16". offload / gpu_memory_gb: the pipeline's default memory policy (with one set,
    or load_on_host, weights load into host memory first). parallel: a ParallelLayout /
    ParallelConfig (None = one process). On a GPU, the kernels' one-time set-up (Triton's, cuBLAS's,
    cuDNN's, the family's first_kernels) runs beside the load, not in the first request
    (mmgen.layers.kernel_set_up).
    """
    if task not in TASKS:
        raise ValidationError(f"task {task!r}: allowed values are {', '.join(TASKS)}")
    directory = model_directory(model)
    family = family_of(directory)
    if device.startswith("cuda"):
        start_kernel_set_up(
            _kernels_device(device, parallel), getattr(torch, dtype), _first_kernels(family, parallel)
        )
    return family.load(
        directory,
        task=task,
        device=device,
        dtype=dtype,
        offload=offload,
        gpu_memory_gb=gpu_memory_gb,
        load_on_host=load_on_host,
        parallel=parallel,
    )


def _first_kernels(family: Family, parallel: Any) -> Callable[[torch.device, torch.dtype], None] | None:
    """The family's first_kernels where this process runs what comes before the first step: in a world
    only rank 0 encodes (mmgen.parallel.layout.reads_for_world; the others hold no text encoder)."""
    if parallel is None:
        return family.first_kernels
    from mmgen.parallel.layout import reads_for_world  # (imports torch.distributed: only for a world)

    return family.first_kernels if reads_for_world(parallel) else None


def _kernels_device(device: str, parallel: Any) -> torch.device:
    """The GPU a load onto `device` ("cuda" or "cuda:N") runs its kernels on: a rank's (parallel given)
    is this thread's current device, set before its load; else the one named ("cuda": the current)."""
    return calling_thread_gpu("cuda" if parallel is not None else device)


def makes_images(model: str | Path | None) -> bool:
    """Whether `model`'s family makes images (a .png, task 't2i') rather than videos: False for None
    (the embedded default, a Wan model) and for a directory no family reads (its load says why)."""
    family = None if model is None else detect(model)
    return family is not None and family.outputs == "image"


def model_heads(directory: str | Path) -> int | None:
    """The attention heads of `directory`'s transformer as its family reads them from its config files
    (Family.heads; no weights); None where the family declares no reader or the config does not say."""
    directory = Path(directory)
    family = family_of(directory)
    return None if family.heads is None else family.heads(directory)
