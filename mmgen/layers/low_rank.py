"""A Linear layer with a low-rank product beside its frozen weight (unfused LoRA).

`LowRankLinear` takes over an existing nn.Linear *without copying it*: it holds the very same
weight and bias Parameter objects, so state-dict keys, values and any views into a stacked matrix
(WanAttention.fuse_projections) stay what they were, and putting the original module back undoes
it exactly. The adapter is one pair of matrices whatever the number of LoRAs: their down matrices
stacked along the rank, their up matrices stacked likewise and pre-multiplied by each LoRA's scale
(so no separate scaling pass ever runs).

How the low-rank term is computed is the layer's `kernel` (all compute the same formula; they differ
in memory traffic; benchmarks/RESULTS.md 10-10c has the bytes model and the measurements):
- "shared-down": layers fed by one input (the stacked q/k/v GEMM) share one down-projection GEMM (x
  read once for all three), then each up-projection is added into the output by the GEMM itself
  (addmm_, beta=1: one read and write of y); an activation (the FFN's GELU) runs as a separate pass.
- "fused-add": as "shared-down", but the up-projection, the add and the activation are one Triton
  pass over y (cuBLAS keeps the main GEMM): the FFN's GELU costs no extra read and write of y.
  CUDA, bf16/fp16, Triton; elsewhere "shared-down".
- "concat": y = x W^T + b + (x D^T) U^T = [x | h] [W | U]^T + b with h = x D^T. The producer of x
  (a WanBlock norm kernel; for the o-projections the attention, where its impl writes into a
  given buffer: WanAttention.output_spare_columns) writes x into a row buffer with spare columns
  ([M, K + R]); one cuBLAS GEMM writes h into those columns in place (torch.mm out= a column
  view: cuBLAS takes the row stride as its leading dimension, nothing is copied), and ONE cuBLAS
  GEMM over the K + R columns against the group's concatenated weight [W | U] computes the whole
  layer, bias and the FFN's GELU epilogue included. Extra cost: one read of x for h and R/K more GEMM work; y is written once.
  Stacked layers (q/k/v) share one down-projection (their D's stacked) and a block-structured
  weight [[W_q | U_q 0 0], [W_k | 0 U_k 0], [W_v | 0 0 U_v]]. The concatenated weight is the
  storage of the layers' own weight Parameters (they become its first K columns: one copy, made
  by mmgen.lora.pack when the LoRAs are applied, undone bitwise on removal). It needs the padded
  input: where x comes from elsewhere (GELU output -> FFN down: cuBLASLt's GELU epilogue writes
  contiguous rows only; text -> cross k/v; an attention impl that does not write into a given buffer
  -> o) or no concatenated weight exists, "concat" runs "fused-add". Any device and dtype.
- "auto" (the default): "concat" where it applies (a concatenated weight and a padded input), else
  AUTO_KERNEL where that applies, else "shared-down". Measured (RESULTS.md 10c): +3.04% per step at
  rank 32 on Wan2.1-1.3B 480p, +1.74% on 14B 720p; "fused-add" alone +8.4%. The first path (each
  layer its own down-projection, +12.8%) and a Triton GEMM with the up-projection in its
  accumulator (30-44% behind cuBLAS at Wan's shapes, RESULTS.md 10b) were measured and removed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mmgen.errors import ValidationError
from mmgen.layers.low_rank_tiles import GROUP_ALIGN

LOW_RANK_KERNELS = ("auto", "shared-down", "fused-add", "concat")
AUTO_KERNEL = "fused-add"

ACTIVATIONS = (None, "gelu_tanh")
CONCAT_ALIGN = 8  # spare columns come in multiples of this: 16-byte rows for cuBLAS in bf16
HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_DTYPES = (torch.bfloat16, torch.float16)  # fp32 would run tl.dot in TF32: not the same math


def check_kernel(kernel: str) -> str:
    if kernel not in LOW_RANK_KERNELS:
        raise ValidationError(f"low-rank kernel {kernel!r}: allowed {', '.join(LOW_RANK_KERNELS)}")
    return kernel


class LowRankLinear(nn.Linear):
    """y = x W^T + b + (x D^T) U^T, with W, b those of `base` (shared) and D [R, in], U [out, R]."""

    def __init__(self, base: nn.Linear, down: torch.Tensor, up: torch.Tensor, kernel: str = "auto") -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: that would allocate a second weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self._original = (base,)  # a tuple: the original module is remembered, not registered as a child
        if tuple(down.shape) != (down.shape[0], base.in_features) or tuple(up.shape) != (
            base.out_features,
            down.shape[0],
        ):
            raise ValueError(
                f"low-rank pair down {tuple(down.shape)}, up {tuple(up.shape)} does not fit "
                f"Linear({base.in_features}, {base.out_features})"
            )
        # Buffers (not persistent): they follow .to() with the module and stay out of the state dict.
        self.register_buffer("lora_down", down, persistent=False)
        self.register_buffer("lora_up", up, persistent=False)
        self.kernel = check_kernel(kernel)
        # The "concat" kernel's matrices, set by mmgen.lora.pack on the first LowRankLinear of a group
        # (the Linears whose weights are row blocks of one matrix), None elsewhere: concat_weight
        # [N, K + spare], whose first K columns are the storage of the group's weights, and
        # concat_down [spare, K], the group's down matrices stacked (zero rows past the total rank).
        # concat_members: the group's LowRankLinears in row order (a tuple: not registered as children).
        self.register_buffer("concat_weight", None, persistent=False)
        self.register_buffer("concat_down", None, persistent=False)
        self.concat_members: tuple[LowRankLinear, ...] = ()

    @property
    def original(self) -> nn.Linear:
        """The nn.Linear this layer took over (same weight and bias objects)."""
        return self._original[0]

    def low_rank(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> (x D^T) U^T [..., out] in x's dtype."""
        return F.linear(F.linear(x, self.lora_down), self.lora_up)

    def forward(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        """x [..., in] -> act(x W^T + b + (x D^T) U^T) [..., out]; activation None or 'gelu_tanh'."""
        return low_rank_linear(x, self.weight, self.bias, (self,), activation)


def set_low_rank_kernel(model: nn.Module, kernel: str) -> int:
    """Set `kernel` on every LowRankLinear in `model`; returns how many (for A/B timing and tests)."""
    check_kernel(kernel)
    layers = [m for m in model.modules() if isinstance(m, LowRankLinear)]
    for layer in layers:
        layer.kernel = kernel
    return len(layers)


def resolve_kernel(kernel: str, x: torch.Tensor) -> str:
    """The kernel that runs for an input x without spare columns: 'auto' and 'concat' (which needs
    them) are AUTO_KERNEL; 'fused-add' where it does not apply (CPU, fp32, no Triton) runs
    'shared-down', the same formula with cuBLAS/CPU GEMMs."""
    kernel = AUTO_KERNEL if kernel in ("auto", "concat") else kernel
    if kernel == "fused-add" and not (HAS_TRITON and x.is_cuda and x.dtype in TRITON_DTYPES):
        return "shared-down"
    return kernel


def low_rank_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    layers: Sequence[nn.Module],
    activation: str | None = None,
) -> torch.Tensor:
    """x [..., in] -> act(x W^T + b + the layers' low-rank terms) [..., out].

    weight [out, in] is the layers' weights stacked along rows in order (one layer, or the q/k/v of a
    stacked GEMM); each LowRankLinear among `layers` adds its term to its own block of columns. With
    no LowRankLinear among them this is F.linear (then the activation), byte for byte.
    x may instead be the padded buffer [..., in + concat_columns(layers, weight)] a norm kernel wrote
    (x in its first `in` columns): then the "concat" kernel runs and overwrites the spare columns.
    """
    if activation not in ACTIVATIONS:
        raise ValidationError(f"low_rank_linear activation {activation!r}: allowed {ACTIVATIONS}")
    lows = [layer for layer in layers if isinstance(layer, LowRankLinear)]
    if x.shape[-1] != weight.shape[1]:
        spare = concat_columns(lows, weight)
        if spare == 0 or x.shape[-1] != weight.shape[1] + spare:
            padded = f"or {weight.shape[1] + spare} padded" if spare else "(no 'concat' weight here)"
            raise ValueError(
                f"low_rank_linear: input has {x.shape[-1]} columns; the weight takes {weight.shape[1]} {padded}"
            )
        return _concat(x, bias, lows[0], activation)
    if not lows:
        return _activate(F.linear(x, weight, bias), activation)
    kernel = resolve_kernel(lows[0].kernel, x)
    low = _shared_down(x, lows)
    y = F.linear(x, weight, bias)
    rows = y.view(-1, y.shape[-1])
    if kernel == "fused-add":
        from mmgen.layers.triton_low_rank import add_low_rank_  # optional: triton

        up, group_cols = _triton_up(layers, weight.shape[0], low.shape[-1], lows[0].lora_up)
        add_low_rank_(rows, low, up, activation, group_cols)
        return y
    _add_blocks(rows, low, layers)
    return _activate(y, activation)


def concat_columns(layers: Sequence[nn.Module], weight: torch.Tensor) -> int:
    """Spare input columns the "concat" kernel wants for low_rank_linear(x, weight, bias, layers); 0: it
    does not run (then the input is x itself).

    Nonzero when the first LowRankLinear among `layers` runs "concat" or "auto", holds the concatenated
    weight of exactly these LowRankLinears (mmgen.lora.pack), and `weight` is still that weight's first
    K columns: after a move (.to) or a re-stack of the weights the layout no longer holds, and the
    layers run their other kernel until the LoRAs are applied again.
    """
    lows = [layer for layer in layers if isinstance(layer, LowRankLinear)]
    if not lows or lows[0].kernel not in ("auto", "concat"):
        return 0
    holder = lows[0]
    cat, down = holder.concat_weight, holder.concat_down
    if cat is None or down is None or len(holder.concat_members) != len(lows):
        return 0
    if any(member is not layer for member, layer in zip(holder.concat_members, lows, strict=True)):
        return 0
    width = cat.shape[1]
    layout = (
        weight.dim() == 2
        and tuple(weight.shape) == (cat.shape[0], width - down.shape[0])
        and tuple(weight.stride()) == (width, 1)
        and weight.dtype == cat.dtype
        and weight.device == cat.device == down.device
    )
    # The storage check reads pointers, which traced code (compile_blocks) cannot; strides and shape
    # already tell a moved weight (.to makes it contiguous) from the packed one.
    if layout and not torch.compiler.is_compiling():
        layout = weight.data_ptr() == cat.data_ptr()
    return down.shape[0] if layout else 0


def _concat(x: torch.Tensor, bias: torch.Tensor | None, holder: LowRankLinear, activation: str | None):
    """x padded [..., K + spare] -> act([x | x D^T] [W | U]^T + b) [..., N]: one GEMM writes h = x D^T
    into x's spare columns, one GEMM over all K + spare columns makes the output (see the module doc)."""
    cat, down = holder.concat_weight, holder.concat_down
    width, spare = cat.shape[1], down.shape[0]
    rows = x.reshape(-1, width)  # a view of a whole buffer; a copy only of a strided token range of one
    if torch.compiler.is_compiling():
        # Dynamo cannot trace out= into a strided view (a graph break); inductor writes h [M, R] and
        # copies it into the spare columns instead: a few MB more per layer.
        rows[:, width - spare :] = rows[:, : width - spare] @ down.t()
    else:
        # out= a column block: cuBLAS writes it in place with the buffer's row stride as leading dimension.
        torch.mm(rows[:, : width - spare], down.t(), out=rows[:, width - spare :])
    if activation is not None and rows.is_cuda and bias is not None:
        out = gelu_tanh_epilogue(rows, cat, bias)  # the FFN keeps its GELU epilogue, as GeluTanhProjection
    else:
        out = _activate(F.linear(rows, cat, bias), activation)
    return out.view(*x.shape[:-1], cat.shape[0])


def gelu_tanh_epilogue(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """CUDA: x [M, K], weight [N, K], bias [N] -> gelu_tanh(x W^T + b) [M, N] with the bias and the GELU in
    cuBLASLt's matmul epilogue (torch._addmm_activation, whose CUDA GELU is the tanh approximation;
    on CPU that op's GELU is the erf form, so callers use it on CUDA only)."""
    return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)


def add_low_rank_terms(x: torch.Tensor, y: torch.Tensor, layers: Sequence[nn.Module]) -> torch.Tensor:
    """y [..., out] += the layers' low-rank terms of x [..., in], in place; returns y.

    For a main GEMM that low_rank_linear does not run itself (the FP8 GEMM of
    mmgen.layers.fp8_linear): y is its output, the layers stacked along its columns as in
    low_rank_linear. Always the 'shared-down' kernel (one down-projection, addmm_ into each block),
    whatever the layers' `kernel`: the Triton kernels' main GEMM is the bf16 one. y must be
    contiguous in its rows; with no LowRankLinear among the layers it is returned untouched.
    """
    lows = [layer for layer in layers if isinstance(layer, LowRankLinear)]
    if not lows:
        return y
    _add_blocks(y.view(-1, y.shape[-1]), _shared_down(x, lows), layers)
    return y


def _shared_down(x: torch.Tensor, lows: Sequence[LowRankLinear]) -> torch.Tensor:
    """x [..., in] -> low [M, R total]: one down-projection GEMM for every layer of the group (x read once)."""
    down = lows[0].lora_down if len(lows) == 1 else torch.cat([layer.lora_down for layer in lows])
    hidden = F.linear(x, down)
    return hidden.reshape(-1, hidden.shape[-1])


def _add_blocks(rows: torch.Tensor, low: torch.Tensor, layers: Sequence[nn.Module]) -> None:
    """rows [M, out] += each LowRankLinear's up-projection of its rank columns of low [M, R total]."""
    rank = 0
    for layer, start in _blocks(layers):
        if isinstance(layer, LowRankLinear):
            width = layer.lora_down.shape[0]
            # addmm_ adds into the output's own columns (a strided view cuBLAS takes as it is).
            rows[:, start : start + layer.out_features].addmm_(low[:, rank : rank + width], layer.lora_up.t())
            rank += width


def _blocks(layers: Sequence[nn.Module]) -> list[tuple[nn.Module, int]]:
    """Each layer with the first output column of its block in the stacked output."""
    blocks, start = [], 0
    for layer in layers:
        blocks.append((layer, start))
        start += layer.out_features
    return blocks


def _triton_up(
    layers: Sequence[nn.Module], out: int, rank: int, like: torch.Tensor
) -> tuple[torch.Tensor, int | None]:
    """The Triton kernels' up matrix and group width: for a stack of equal layers that all carry one
    rank and whose width the kernels' tiles divide, the ups stacked along rows (each tile reads its
    own layer's rank columns of low); else the block-diagonal matrix over the whole output."""
    widths = {layer.out_features for layer in layers}
    ranks = {layer.lora_down.shape[0] if isinstance(layer, LowRankLinear) else 0 for layer in layers}
    if len(layers) > 1 and len(widths) == 1 and len(ranks) == 1 and 0 not in ranks:
        width = widths.pop()
        if width % GROUP_ALIGN == 0:
            return torch.cat([layer.lora_up for layer in layers]), width
    return _stacked_up(layers, out, rank, like), None


def _stacked_up(layers: Sequence[nn.Module], out: int, rank: int, like: torch.Tensor) -> torch.Tensor:
    """U [out, R total]: each LowRankLinear's up matrix in its rows and rank columns, zeros elsewhere."""
    if len(layers) == 1:
        return layers[0].lora_up
    up = torch.zeros(out, rank, dtype=like.dtype, device=like.device)
    column = 0
    for layer, start in _blocks(layers):
        if isinstance(layer, LowRankLinear):
            width = layer.lora_down.shape[0]
            up[start : start + layer.out_features, column : column + width] = layer.lora_up
            column += width
    return up


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return y if activation is None else F.gelu(y, approximate="tanh")
