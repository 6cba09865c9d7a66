"""Feed-forward blocks with the parameter layout of diffusers' FeedForward (checkpoint names match)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmgen.layers.fp8_linear import Fp8Activation, Fp8WeightCache, dense, linear_fp8, quantize_rows
from mmgen.layers.low_rank import LowRankLinear, gelu_tanh_epilogue


class GeluTanhProjection(nn.Module):
    """Linear then tanh-approximated GELU; its weights live under `proj` as in diffusers' GELU module.

    On CUDA the bias and GELU run in the matmul's epilogue (cuBLASLt, through torch._addmm_activation,
    whose CUDA GELU is the tanh approximation): the [tokens, inner] output is written once instead of
    written, read and written again by a separate GELU. The result differs from the unfused one only
    by the skipped bf16 rounding between the matmul and the GELU. On CPU that op's GELU is the erf
    form, so the CPU path stays unfused. `fuse_epilogue = False` turns the fusion off (for A/B timing).
    """

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)
        self.fuse_epilogue = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim_in] -> gelu_tanh(x W^T + b) [..., dim_out] in x's dtype."""
        # Only a plain Linear: the epilogue reads its weight directly, which would skip a LoRA beside it.
        if self.fuse_epilogue and x.is_cuda and self.proj.bias is not None and type(self.proj) is nn.Linear:
            flat = x.reshape(-1, x.shape[-1])
            out = gelu_tanh_epilogue(flat, self.proj.weight, self.proj.bias)
            return out.view(*x.shape[:-1], out.shape[-1])
        if isinstance(self.proj, LowRankLinear):  # an unfused LoRA: the layer applies the GELU itself
            return self.proj(x, activation="gelu_tanh")
        return F.gelu(self.proj(x), approximate="tanh")


class GeluTanhFeedForward(nn.Module):
    """x [..., dim] -> Linear(dim, inner) -> GELU(tanh) -> Linear(inner, dim).

    The layers sit at net.0 and net.2: checkpoints keep a dropout at index 1, which holds no weights,
    so an Identity keeps the indices (and thus the state-dict keys) the checkpoints use.
    """

    def __init__(self, dim: int, inner_dim: int) -> None:
        super().__init__()
        self.net = nn.ModuleList(
            [GeluTanhProjection(dim, inner_dim), nn.Identity(), nn.Linear(inner_dim, dim)]
        )
        # The quantized weights of the layers a call runs in FP8 (mmgen.layers.fp8_linear), cached
        # per layer across calls and re-made only when a weight changes.
        self.fp8_weights = Fp8WeightCache()

    def forward(
        self,
        x: torch.Tensor | Fp8Activation,
        *,
        token_chunk: int | None = None,
        fp8_layers: frozenset[str] = frozenset(),
    ) -> torch.Tensor:
        """x [..., S, dim] -> [..., S, dim]; in token_chunk pieces along S when given and S is longer.

        token_chunk: tokens per piece (a memory plan's ffn_chunk); each token's output depends on
        that token alone, so pieces only bound the [tokens, inner] activation. fp8_layers: which of
        the two layers run in FP8 ("in", "out"); x may then come quantized (Fp8Activation).
        """
        tokens = x.shape[-2] if len(x.shape) >= 2 else 0
        if token_chunk is None or tokens <= token_chunk:
            return self._run(x, fp8_layers)
        out = None
        for start in range(0, tokens, token_chunk):
            # Tensor and Fp8Activation both narrow; the output takes the first piece's dtype and device.
            part = self._run(x.narrow(-2, start, min(token_chunk, tokens - start)), fp8_layers)
            if out is None:
                out = part.new_empty(*x.shape[:-1], part.shape[-1])
            out[..., start : start + token_chunk, :] = part
        return out

    def _run(self, x: torch.Tensor | Fp8Activation, fp8_layers: frozenset[str]) -> torch.Tensor:
        if fp8_layers:
            return self._run_fp8(x, fp8_layers)
        for layer in self.net:
            x = layer(x)
        return x

    def _run_fp8(self, x: torch.Tensor | Fp8Activation, fp8_layers: frozenset[str]) -> torch.Tensor:
        # FP8 down-projection: its input is quantized where the GELU is computed (one Triton pass on
        # the up-projection's output), since the cuBLASLt GELU epilogue has no FP8 output here.
        first, last = self.net[0].proj, self.net[2]
        quantize_out = "out" in fp8_layers
        if "in" in fp8_layers:
            pre = linear_fp8(first, x, self.fp8_weights, "in")
            hidden = quantize_rows(pre, gelu=True) if quantize_out else F.gelu(pre, approximate="tanh")
        else:
            hidden = self.net[0](dense(x, first.weight.dtype))
            hidden = quantize_rows(hidden) if quantize_out else hidden
        return linear_fp8(last, hidden, self.fp8_weights, "out") if quantize_out else last(hidden)
