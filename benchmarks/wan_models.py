"""The Wan models the DiT benchmarks time: presets at full size, a tiny config for CPU smoke runs, and
diffusers' WanTransformer3DModel and mmgen's WanDiT holding the same random bf16 weights."""

from __future__ import annotations

from pathlib import Path

import torch

from mmgen.loading.wan_transformer import wan_dit_from_tensors
from mmgen.models.wan import WanConfig, WanDiT

RANDOM = Path("<random weights>")

MODELS = {
    "1.3b": (WanConfig.wan21_t2v_1_3b(), (480, 832, 81)),
    "14b": (WanConfig.wan21_t2v_14b(), (720, 1280, 81)),
}

TINY = WanConfig(
    num_attention_heads=2,
    attention_head_dim=64,
    in_channels=16,
    out_channels=16,
    text_dim=64,
    freq_dim=32,
    ffn_dim=256,
    num_layers=2,
    text_len=32,
)

TINY_VIDEO = (64, 96, 9)  # height, width, frames of the --tiny runs


def model_and_video(args) -> tuple[WanConfig, tuple[int, int, int]]:
    """The config and (height, width, frames) a script's --model/--tiny/--height/--width/--frames ask for."""
    config, video = (TINY, TINY_VIDEO) if args.tiny else MODELS[args.model]
    return config, (args.height or video[0], args.width or video[1], args.frames or video[2])


def add_model_args(parser) -> None:
    """--model, --tiny, --height, --width, --frames (read back by model_and_video)."""
    parser.add_argument("--model", choices=sorted(MODELS), default="1.3b")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny config and sizes (harness smoke run, CPU ok)"
    )
    parser.add_argument("--height", type=int, help="video height (default: the model's)")
    parser.add_argument("--width", type=int, help="video width")
    parser.add_argument("--frames", type=int, help="video frames (4k + 1)")


def build_models(config: WanConfig, device: torch.device, *, seed: int = 0) -> tuple[torch.nn.Module, WanDiT]:
    """diffusers WanTransformer3DModel (bf16, its fp32 modules fp32) and mmgen WanDiT with the same weights.

    Built directly on `device` (diffusers' own initialisation, seeded with `seed`); the two models
    share every weight tensor (no second copy)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build in bf16: a 14B model built in fp32 would need 57 GB
    try:
        with torch.device(device):
            reference = WanTransformer3DModel(**config.to_diffusers_config())
    finally:
        torch.set_default_dtype(previous)
    keep = WanTransformer3DModel._keep_in_fp32_modules  # what from_pretrained(torch_dtype=bf16) keeps fp32
    for name, param in reference.named_parameters():
        if any(part in keep for part in name.split(".")):
            param.data = param.data.float()
    reference.eval().requires_grad_(False)
    model = wan_dit_from_tensors(
        config,
        {name: (t, RANDOM) for name, t in reference.state_dict().items()},
        source=RANDOM,
        dtype=torch.bfloat16,
        device=device,
    )
    return reference, model
