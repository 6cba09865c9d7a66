"""Dtype names: every spelling a caller may use for the dtypes weights load in, checked once.

The faces (`mmgen generate`, render files, `mmgen enhance`) and the pipelines' `from_pretrained` all
accept torch's names (float32, bfloat16, float16), the short ones (fp32, bf16, fp16) and torch dtypes.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from mmgen.errors import ValidationError

# The dtypes weights load in, by every name a caller may use: torch's, and the CLI's short ones.
DTYPE_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "float32": "float32",
        "fp32": "float32",
        "bfloat16": "bfloat16",
        "bf16": "bfloat16",
        "float16": "float16",
        "fp16": "float16",
    }
)


def check_dtype(dtype: Any = None, *, torch_dtype: Any = None) -> Any:
    """The torch dtype of `dtype` (diffusers' keyword `torch_dtype` is the same thing): torch.float32 /
    bfloat16 / float16 or a name float32|bfloat16|float16|fp32|bf16|fp16; None = float32."""
    if torch_dtype is not None:
        if dtype is not None and check_dtype(dtype) != check_dtype(torch_dtype):
            raise ValidationError(f"dtype {dtype!r} and torch_dtype {torch_dtype!r} disagree: give one")
        dtype = torch_dtype
    if dtype is None:
        return torch.float32
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else None
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValidationError(
            f"dtype {dtype!r}: allowed torch.float32, torch.bfloat16, torch.float16 or the names "
            f"{'|'.join(DTYPE_NAMES)}"
        )
    return getattr(torch, DTYPE_NAMES[name])


__all__ = ("DTYPE_NAMES", "check_dtype")
