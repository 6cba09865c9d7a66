"""Module construction on the meta device (every checkpoint load) without torch's meta-tensor refs.

A few of torch's initializers (randn, normal_, division) run, on meta tensors, through
torch._refs functions whose first call imports torch._dynamo and sympy: ~1.5 s of a CPU start, for
values the checkpoint overwrites anyway. On the meta device these helpers leave the tensor empty;
elsewhere they initialize exactly as before (same values, same draws from the generator).
"""

from __future__ import annotations

import torch
from torch import nn


def building_on_meta() -> bool:
    """Whether tensors created now land on the meta device (inside `with torch.device("meta")`)."""
    return torch.empty(0).device.type == "meta"


def embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """nn.Embedding(num_embeddings, dim); on the meta device without its normal_ init."""
    if building_on_meta():
        return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))
    return nn.Embedding(num_embeddings, dim)
