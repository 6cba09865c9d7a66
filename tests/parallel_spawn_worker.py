"""A worker for the spawned-world test, importing only torch and mmgen.parallel (fresh interpreters are slow)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mmgen.parallel.layout import ParallelLayout


def world_ranks(layout: ParallelLayout) -> list[int]:
    """Every rank's number, all-gathered over the SP group (a spawned world works end to end)."""
    ranks = [torch.zeros(1, dtype=torch.int64) for _ in range(layout.sp_degree)]
    dist.all_gather(ranks, torch.tensor([layout.rank]), group=layout.sp_group)
    return [int(r) for r in ranks]
