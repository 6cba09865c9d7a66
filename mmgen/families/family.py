"""One model family as a value: how its directories are recognised, how it loads, what it can do.

A family is declared once, as a `Family`: mmgen's own in mmgen.families.builtin, any other by an
installed package (an entry point in the group `mmgen.families`, see mmgen.families.registry). No
face (CLI, render, ab, serve, Ray) names a family; each asks the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from mmgen.errors import ValidationError
from pipelines.capabilities import Capabilities
from pipelines.presets import presets_of


class Loader(Protocol):
    """A family's loader: a model directory of the family -> its pipeline, ready to `generate(request)`.

    task: 't2v', 't2i' or 'i2v' (pipelines.loader.TASKS); device and dtype: resolved names ("cuda",
    "bfloat16"); offload / gpu_memory_gb / load_on_host: the memory policy asked at load (a family
    without a memory planner refuses the budget); parallel: a ParallelLayout or ParallelConfig, None
    for one process. A request the family cannot serve is refused with a ValidationError naming it.
    """

    def __call__(
        self,
        directory: Path,
        *,
        task: str,
        device: str,
        dtype: str,
        offload: str | None,
        gpu_memory_gb: float | None,
        load_on_host: bool | None,
        parallel: Any,
    ) -> Any: ...


@dataclass(frozen=True)
class Family:
    """name: the family's id (also its presets' family, pipelines.presets); title: how messages name it.

    capabilities: what the family's models can do, together (a loaded model reports its own through
    `pipe.capabilities`); its `outputs` is what a model of the family makes before one is loaded
    (`mmgen generate` writes a .png for an image family). pipeline_classes: the model_index.json
    `_class_name`s of its diffusers-format directories. original_layout: whether a directory without
    model_index.json is the family's original release layout (None: the family has none);
    original_layouts says which, for errors. load: the family's Loader.

    heads: how the family reads a directory's attention heads from its config files alone (no
    weights), so that a layout over several processes (`--gpus`) whose Ulysses degree does not
    split them is refused before any process spawns; None: the family declares none (its loader
    checks after the ranks start). ring: whether its attention also runs a ring (--ring); without
    one, --sp is its Ulysses degree. A family whose capabilities lack "parallel" runs in one process.

    first_kernels(device, dtype): launches on tiny inputs, on a CUDA device, the kernels its pipeline's
    first request launches before its first step that the common set-up does not (Wan: its UMT5 text
    encoder's); run beside the load (mmgen.layers.kernel_set_up), its results dropped. None: none.
    """

    name: str
    title: str
    capabilities: Capabilities
    pipeline_classes: tuple[str, ...]
    load: Loader
    original_layout: Callable[[Path], bool] | None = None
    original_layouts: str = ""
    heads: Callable[[Path], int | None] | None = None
    ring: bool = True
    first_kernels: Callable[[torch.device, torch.dtype], None] | None = None

    def __post_init__(self) -> None:
        if not self.name or (not self.pipeline_classes and self.original_layout is None):
            raise ValidationError(
                f"family {self.name!r}: needs a name and a way to recognise its directories "
                "(pipeline_classes, original_layout or both)"
            )

    @property
    def outputs(self) -> str:
        """'video' or 'image': what a model of this family makes by default."""
        return self.capabilities.outputs

    @property
    def presets(self) -> tuple[str, ...]:
        """The presets of this family (pipelines.presets, whose entries name their family)."""
        return presets_of(self.name)

    def reads(self, directory: Path, class_name: str | None) -> bool:
        """Whether `directory` is one of this family's: its model_index.json `_class_name` (None when
        the directory has no model_index.json) is one of ours, or it is our original layout."""
        if class_name is not None:
            return class_name in self.pipeline_classes
        return self.original_layout is not None and self.original_layout(directory)
