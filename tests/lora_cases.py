"""Tiny LoRAs in every format mmgen reads, built from a model's own weight shapes (shared by LoRA tests).

Each builder returns (state dict, safetensors metadata or None) holding random low-rank pairs for
every attention and FFN Linear of every block, in the layout of one format, plus that format's
extras (alpha keys, lightx2v-style bias deltas and all-zero norm deltas).
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from mmgen.layers.low_rank import LowRankLinear
from mmgen.models.wan import WanConfig

# The LoRA kernel tests' two-block DiT.
TINY = WanConfig(
    num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32,
    freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32,
)  # fmt: skip

ATTN = (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"))
FFN = (("ffn.0", "ffn.net.0.proj"), ("ffn.2", "ffn.net.2"))


def linears(num_layers: int) -> list[tuple[str, str]]:
    """(original module name, diffusers module name) of every block Linear a Wan LoRA targets."""
    out = []
    for i in range(num_layers):
        for attn, layer in (("self_attn", "attn1"), ("cross_attn", "attn2")):
            out += [(f"blocks.{i}.{attn}.{o}", f"blocks.{i}.{layer}.{c}") for o, c in ATTN]
        out += [(f"blocks.{i}.{o}", f"blocks.{i}.{c}") for o, c in FFN]
    return out


def _pair(params: dict, module: str, rank: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    out_dim, in_dim = params[f"{module}.weight"].shape
    down = torch.randn(rank, in_dim, generator=gen) * 0.2
    up = torch.randn(out_dim, rank, generator=gen) * 0.2
    return down, up


def wan_lora(
    model, *, rank: int = 4, alpha: float | None = 8.0, seed: int = 0, extras: bool = True, up_down=True
):
    """Original Wan / ComfyUI / lightx2v layout: diffusion_model.<module>.lora_down/lora_up/alpha (+ diff_b, norms)."""
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(seed)
    names = ("lora_down", "lora_up") if up_down else ("lora_A", "lora_B")
    state = {}
    for original, ours in linears(model.config.num_layers):
        down, up = _pair(params, ours, rank, gen)
        state[f"diffusion_model.{original}.{names[0]}.weight"] = down
        state[f"diffusion_model.{original}.{names[1]}.weight"] = up
        if alpha is not None:
            state[f"diffusion_model.{original}.alpha"] = torch.tensor(alpha)
    if extras:
        for i in range(model.config.num_layers):
            bias = params[f"blocks.{i}.attn1.to_q.bias"]
            state[f"diffusion_model.blocks.{i}.self_attn.q.diff_b"] = (
                torch.randn(bias.shape, generator=gen) * 0.1
            )
            state[f"diffusion_model.blocks.{i}.ffn.0.diff_b"] = (
                torch.randn(params[f"blocks.{i}.ffn.net.0.proj.bias"].shape, generator=gen) * 0.1
            )
            dim = params[f"blocks.{i}.attn1.norm_q.weight"].shape
            for norm in ("self_attn.norm_q", "self_attn.norm_k", "cross_attn.norm_q", "cross_attn.norm_k"):
                state[f"diffusion_model.blocks.{i}.{norm}.diff"] = torch.zeros(dim)
            state[f"diffusion_model.blocks.{i}.norm3.diff"] = torch.zeros(dim)
            state[f"diffusion_model.blocks.{i}.norm3.diff_b"] = torch.zeros(dim)
    return state, None


def musubi_lora(model, *, rank: int = 4, alpha: float = 2.0, seed: int = 0):
    """kohya / musubi-tuner layout: lora_unet_<module with underscores>.lora_down/lora_up/alpha."""
    state, _ = wan_lora(model, rank=rank, alpha=alpha, seed=seed, extras=False)
    flat = {}
    for key, value in state.items():
        module, _, suffix = key.removeprefix("diffusion_model.").partition(".lora_")
        if key.endswith(".alpha"):
            module, suffix = key.removeprefix("diffusion_model.").removesuffix(".alpha"), None
        name = "lora_unet_" + module.replace(".", "_")
        flat[name + (f".lora_{suffix}" if suffix else ".alpha")] = value
    return flat, None


def diffusers_lora(model, *, rank: int = 4, alpha: float | None = 8.0, seed: int = 0, bias: bool = False):
    """diffusers / PEFT layout: transformer.<module>.lora_A/lora_B.weight, the LoraConfig in the metadata."""
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(seed)
    state, modules = {}, []
    for _, ours in linears(model.config.num_layers):
        down, up = _pair(params, ours, rank, gen)
        state[f"transformer.{ours}.lora_A.weight"] = down
        state[f"transformer.{ours}.lora_B.weight"] = up
        if bias:
            out_dim = params[f"{ours}.bias"].shape
            state[f"transformer.{ours}.lora_B.bias"] = torch.randn(out_dim, generator=gen) * 0.1
        modules.append(ours)
    if alpha is None:
        return state, None
    config = {
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(modules),
        "alpha_pattern": {"blocks.1.ffn.net.2": alpha / 2},  # one module scaled differently, as PEFT allows
        "rank_pattern": {},
        "lora_bias": bias,
    }
    packed = {f"transformer.{k}": v for k, v in config.items()}
    return state, {"format": "pt", "lora_adapter_metadata": json.dumps(packed)}


def save(path, state, metadata=None):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata=metadata)
    return path


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Max |got - expected| over max |expected|. fp32 rounding scales with the values: a few ulps
    (2^-24 relative each) of the largest, in whatever order a CPU's BLAS sums them, so a bound on
    outputs as large as the stacked groups' (~20, from unit-variance weights) is stated relative."""
    expected = expected.double()
    return ((got.double() - expected).abs().max() / expected.abs().max()).item()


def low_rank_reference(layers, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """float64: each layer's x W^T + b (+ (x D^T) U^T for a LowRankLinear), concatenated along the
    features, then the activation (None or 'gelu_tanh'): what every low-rank kernel must compute."""
    x = x.double()
    parts = []
    for layer in layers:
        y = F.linear(x, layer.weight.double(), layer.bias.double())
        if isinstance(layer, LowRankLinear):
            y = y + F.linear(F.linear(x, layer.lora_down.double()), layer.lora_up.double())
        parts.append(y)
    y = torch.cat(parts, dim=-1)
    return y if activation is None else F.gelu(y, approximate="tanh")
