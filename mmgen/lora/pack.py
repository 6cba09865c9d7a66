"""The "concat" LoRA kernel's weights: one [W | U] matrix per group, the storage of the layers' own weights.

mmgen.layers.low_rank's "concat" kernel runs a group of Linears (one layer, or q/k/v stacked by
WanDiT.fuse_projections) as ONE GEMM over [x | h] against [W | U], h = x D^T. Packing gives each
group that matrix without a second copy of W: a new [N, K + spare] matrix is filled with the
weights and the up matrices (block-structured for a stack: each layer's U in its own rows and rank
columns, zeros elsewhere), and every tensor that viewed the old weight storage (the layers' weight
Parameters, a stacked matrix such as WanAttention.fused_weight) is re-pointed at the same rows of
its first K columns. Objects, names, values and the views between them stay what they were, so the
state dict is unchanged; the old storage is freed. `unpack` copies the first K columns into a fresh
contiguous storage and re-points the same tensors there: bitwise the weights they had.

A group whose storage holds anything other than row blocks of one row-major [N, K] matrix (e.g. a
checkpoint read into one shared buffer) is left as it is: its layers run their other kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mmgen.layers.low_rank import CONCAT_ALIGN, LowRankLinear


def pack_concat(
    model: nn.Module, wanted: Callable[[tuple[str, ...]], bool], align: int = CONCAT_ALIGN
) -> list[LowRankLinear]:
    """Give each group of `model` that holds a LowRankLinear and whose module names (in row order)
    `wanted` accepts its concatenated weight (on the group's first LowRankLinear); returns those
    holders, for unpack_concat.

    align: the spare columns are the group's total rank rounded up to a multiple of this (a multiple
    of CONCAT_ALIGN); zero columns past the rank cost GEMM work but may give cuBLAS a K it tiles
    better and 128-byte rows (benchmarks/lora_step.py --concat-aligns measures it).
    """
    if align <= 0 or align % CONCAT_ALIGN:
        raise ValueError(f"pack_concat align={align}: a positive multiple of {CONCAT_ALIGN}")
    viewers = _tensors_by_storage(model)
    groups: dict[tuple, list[tuple[str, nn.Linear]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.weight.device.type != "meta":
            groups.setdefault(_storage_key(module.weight), []).append((name, module))
    holders = []
    with torch.no_grad():
        for key, members in groups.items():
            members.sort(key=lambda member: member[1].weight.storage_offset())
            names = tuple(name for name, _ in members)
            if any(isinstance(module, LowRankLinear) for _, module in members) and wanted(names):
                holder = _pack([module for _, module in members], viewers[key], align)
                if holder is not None:
                    holders.append(holder)
    return holders


def unpack_concat(model: nn.Module, holders: list[LowRankLinear]) -> None:
    """Undo pack_concat: the weights get contiguous storage again (bitwise their values), the holders
    drop their concatenated matrices. Safe after a move that already separated the tensors."""
    if not holders:
        return
    viewers = _tensors_by_storage(model)
    with torch.no_grad():
        for holder in holders:
            cat = holder.concat_weight
            holder.concat_weight, holder.concat_down, holder.concat_members = None, None, ()
            if cat is None:
                continue
            width, dim = cat.shape[1], holder.in_features
            fresh = cat[:, :dim].contiguous()
            for tensor in viewers.get(_storage_key(cat), []):
                if tensor is cat or tensor.dim() != 2 or tuple(tensor.stride()) != (width, 1):
                    continue
                row = (tensor.storage_offset() - cat.storage_offset()) // width
                tensor.data = fresh[row : row + tensor.shape[0], : tensor.shape[1]]


def _pack(linears: list[nn.Linear], viewers: list[torch.Tensor], align: int) -> LowRankLinear | None:
    """Pack one group (Linears sharing a weight storage); None where its layout is not plain rows."""
    dim = linears[0].in_features
    start = min(tensor.storage_offset() for tensor in viewers)
    for tensor in viewers:  # every view must be whole rows of one row-major [N, dim] matrix
        if (
            tensor.dim() != 2
            or tensor.shape[1] != dim
            or tuple(tensor.stride()) != (dim, 1)
            or (tensor.storage_offset() - start) % dim
        ):
            return None
    linears = sorted({id(m): m for m in linears}.values(), key=lambda m: m.weight.storage_offset())
    rows = [(linear, (linear.weight.storage_offset() - start) // dim) for linear in linears]
    total = max((t.storage_offset() - start) // dim + t.shape[0] for t in viewers)
    lows = [linear for linear, _ in rows if isinstance(linear, LowRankLinear)]
    rank = sum(low.lora_down.shape[0] for low in lows)
    spare = -(-rank // align) * align
    # Zero rows of D beyond the rank make h's padding columns zeros (never uninitialized values, which
    # a zero weight column would still turn into NaN when they hold Inf or NaN bits).
    like = linears[0].weight
    cat = torch.zeros(total, dim + spare, dtype=like.dtype, device=like.device)
    down = torch.zeros(spare, dim, dtype=like.dtype, device=like.device)
    matrix = torch.empty(0, dtype=like.dtype, device=like.device).set_(
        like.untyped_storage(), start, (total, dim), (dim, 1)
    )
    cat[:, :dim] = matrix
    column = dim
    for linear, row in rows:
        if isinstance(linear, LowRankLinear):
            width = linear.lora_down.shape[0]
            cat[row : row + linear.out_features, column : column + width] = linear.lora_up
            down[column - dim : column - dim + width] = linear.lora_down
            column += width
    del matrix
    for tensor in viewers:
        row = (tensor.storage_offset() - start) // dim
        tensor.data = cat[row : row + tensor.shape[0], :dim]
    holder = lows[0]
    holder.concat_weight, holder.concat_down, holder.concat_members = cat, down, tuple(lows)
    return holder


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.untyped_storage().data_ptr())


def _tensors_by_storage(model: nn.Module) -> dict[tuple, list[torch.Tensor]]:
    """Every parameter and buffer of `model` (each object once), by the storage it views."""
    found: dict[tuple, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen and tensor.device.type != "meta":
            seen.add(id(tensor))
            found.setdefault(_storage_key(tensor), []).append(tensor)
    return found
