"""ParallelLayout: which process this is and which process groups it works with, as a frozen value.

Built once at start-up (one process: `ParallelLayout.single()`), then passed explicitly from the
pipeline to the model call to the attention site, like DiTAttention. There are no module-level
groups to look up; a function that needs a group receives the layout.

Ranks: world = cfg_degree x sp_degree. The CFG group holds the ranks that compute the conditional
and unconditional halves of a guided step; the sequence-parallel group holds the ranks that share
one sample's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmgen.errors import ValidationError


@dataclass(frozen=True)
class ParallelLayout:
    """world_size = cfg_degree * sp_degree processes; groups are torch.distributed groups (None = alone)."""

    world_size: int = 1
    rank: int = 0
    device: torch.device | None = None
    sp_degree: int = 1
    sp_rank: int = 0
    sp_group: Any = None
    cfg_degree: int = 1
    cfg_rank: int = 0
    cfg_group: Any = None

    def __post_init__(self) -> None:
        if self.sp_degree < 1 or self.cfg_degree < 1 or self.cfg_degree > 2:
            raise ValidationError(
                f"parallel layout: sp_degree {self.sp_degree} must be >= 1, cfg_degree {self.cfg_degree} 1 or 2"
            )
        if self.world_size != self.sp_degree * self.cfg_degree:
            raise ValidationError(
                f"parallel layout: world_size {self.world_size} != sp_degree {self.sp_degree} "
                f"x cfg_degree {self.cfg_degree}"
            )
        if not (0 <= self.sp_rank < self.sp_degree and 0 <= self.cfg_rank < self.cfg_degree):
            raise ValidationError(
                f"parallel layout: sp_rank {self.sp_rank} / cfg_rank {self.cfg_rank} out of range"
            )

    @staticmethod
    def single(device: torch.device | str | None = None) -> ParallelLayout:
        """One process doing all the work (no groups)."""
        return ParallelLayout(device=None if device is None else torch.device(device))

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    @property
    def owns_outputs(self) -> bool:
        """Rank 0 writes outputs, manifests and progress bars."""
        return self.rank == 0
