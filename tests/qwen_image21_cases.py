"""Pieces the Qwen-Image-2.1 tests share: a tiny random diffusers transformer and its inputs."""

from __future__ import annotations

from typing import Any

import torch

TINY_TRANSFORMER = {
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 2,
    "context_in_dim": 24,
    "mlp_ratio": 3,
    "axes_dims_rope": (8, 12, 12),
}


def randomize(module: torch.nn.Module, seed: int, std: float = 0.1) -> torch.nn.Module:
    """Every parameter of `module` replaced by seeded normal values (zero-initialized norms included)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * std)
    return module


def tiny_transformer(seed: int = 0) -> Any:
    """diffusers' QwenImage21Transformer2DModel at TINY_TRANSFORMER with random weights, fp32, eval."""
    from diffusers import QwenImage21Transformer2DModel

    torch.manual_seed(seed)
    model = QwenImage21Transformer2DModel(**TINY_TRANSFORMER)
    return randomize(model, seed).eval()


def diffusers_inputs(
    text_lens: list[int],
    slot_runs: list[tuple[int, int]],
    grids: list[tuple[int, int, int]],
    seed: int,
) -> dict[str, Any]:
    """Inputs of diffusers' transformer for prompts of text_lens[b] text-encoder tokens (right-padded to the
    longest, with a mask when they differ); slot_runs: (start, count) of image-slot runs, the same in every
    prompt; grids: condition images then the target."""
    generator = torch.Generator().manual_seed(seed)
    batch, width = len(text_lens), max(text_lens)
    tokens = sum(h * w for _, h, w in grids)
    target = grids[-1][1] * grids[-1][2]
    slots = torch.zeros(batch, width, dtype=torch.bool)
    for start, count in slot_runs:
        slots[:, start : start + count] = True
    mask = torch.arange(width)[None, :] < torch.tensor(text_lens)[:, None]
    slots &= mask
    return {
        "hidden_states": torch.randn(batch, tokens, TINY_TRANSFORMER["in_channels"], generator=generator),
        "encoder_hidden_states": torch.randn(
            batch, width, TINY_TRANSFORMER["context_in_dim"], generator=generator
        ),
        "timestep": torch.rand(batch, generator=generator),
        "img_shapes": [list(grids)] * batch,
        "img_mask": torch.cat([slots, torch.ones(batch, target // 4, dtype=torch.bool)], dim=1),
        "encoder_hidden_states_mask": None if min(text_lens) == width else mask,
        "slots": slots,
        "text_lens": text_lens,
    }


def run_diffusers(model: Any, inputs: dict[str, Any], **kwargs: Any) -> torch.Tensor:
    """diffusers' prediction of the target tokens [B, N, C]."""
    target = inputs["img_shapes"][0][-1][1] * inputs["img_shapes"][0][-1][2]
    names = ("hidden_states", "encoder_hidden_states", "timestep", "img_shapes", "img_mask")
    with torch.no_grad():
        out = model(
            **{name: inputs[name] for name in names},
            encoder_hidden_states_mask=inputs["encoder_hidden_states_mask"],
            return_dict=False,
            **kwargs,
        )[0]
    return out[:, -target:]


def block_layout(inputs: dict[str, Any], grids: Any) -> Any:
    """mmgen's BlockCausalLayout of diffusers_inputs' prompts and `grids`."""
    from mmgen.models.qwen_image21_layout import BlockCausalLayout

    return BlockCausalLayout.build(
        inputs["text_lens"], grids, text_width=inputs["slots"].shape[1], slot_masks=inputs["slots"]
    )


def run_mmgen(model: Any, inputs: dict[str, Any], grids: Any, attention: Any, **kwargs: Any) -> torch.Tensor:
    """mmgen's prediction [B, N, C] of diffusers_inputs; layout= (default: block_layout), cache= pass through."""
    layout = kwargs.pop("layout", None) or block_layout(inputs, grids)
    with torch.no_grad():
        return model(
            inputs["hidden_states"],
            inputs["timestep"],
            inputs["encoder_hidden_states"],
            metadata=layout,
            attention=attention,
            **kwargs,
        )
