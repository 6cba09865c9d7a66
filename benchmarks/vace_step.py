"""One guided Wan2.1-VACE step (cond + uncond) on one GPU: mmgen's WanVACEDiT against diffusers'.

    python3 benchmarks/vace_step.py            # the 14B VACE config, 480x832x81 (32,760 tokens)
    python3 benchmarks/vace_step.py --tiny     # CPU smoke run of the harness (tiny config)

Random bf16 weights go into diffusers' WanVACETransformer3DModel (its fp32 modules kept fp32) and,
sharing every tensor, into mmgen's WanVACEDiT. Rows: diffusers as WanVACEPipeline calls it (cond,
then uncond: two batch-1 calls, the control context in each) and mmgen as its denoise loop calls it
(one batch-2 call, the control expanded; attention 'auto'), eager. Printed: ms per step (median of
--iters after warm-up, CUDA events), speed-up over diffusers, the peak memory above the weights, and
the guided prediction's error against diffusers' (max abs, relative L2).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from bench_utils import (  # noqa: E402
    bench_device,
    environment_header,
    max_abs,
    print_table,
    relative_error,
    timed,
)
from wan_models import TINY, make_inputs  # noqa: E402

from mmgen.attention import select_attention  # noqa: E402
from mmgen.loading.safetensors_dir import load_into_module  # noqa: E402
from mmgen.models.wan import WanConfig  # noqa: E402
from mmgen.models.wan_vace import WanVACEConfig, WanVACEDiT  # noqa: E402

RANDOM = Path("<random weights>")
GUIDANCE = 5.0


def vace_config(base: WanConfig, layers: tuple[int, ...]) -> WanVACEConfig:
    return WanVACEConfig(**{f.name: getattr(base, f.name) for f in fields(WanConfig)}, vace_layers=layers)


def build(config: WanVACEConfig, device: torch.device):
    """(diffusers WanVACETransformer3DModel, mmgen WanVACEDiT) sharing the same random bf16 weights."""
    from diffusers import WanVACETransformer3DModel

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            reference = WanVACETransformer3DModel(**config.to_diffusers_config())
    finally:
        torch.set_default_dtype(previous)
    keep = WanVACETransformer3DModel._keep_in_fp32_modules
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if any(part in keep for part in name.split(".")):
                param.data = param.data.float()
            if name.endswith("proj_out.weight") and "vace_blocks" in name:
                param.normal_(0.0, param.shape[1] ** -0.5)  # diffusers zero-inits the hints: make them count
    reference.eval().requires_grad_(False)
    with torch.device("meta"):
        model = WanVACEDiT(config)
    tensors = {name: (t, RANDOM) for name, t in reference.state_dict().items()}
    load_into_module(
        model, tensors, source=RANDOM, dtype=torch.bfloat16, device=device, keep_fp32=WanVACEDiT.keeps_fp32
    )
    return reference, model.eval().requires_grad_(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny config on the CPU (a smoke run)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    device = bench_device(args.tiny)
    if args.tiny:
        config, video = vace_config(TINY, (0, 1)), (64, 96, 9)
    else:  # Wan2.1-VACE-14B: the 14B DiT, hints into every 5th block
        config, video = vace_config(WanConfig.wan21_t2v_14b(), tuple(range(0, 40, 5))), (480, 832, 81)
    print(environment_header(device))
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    reference, model = build(config, device)
    weights = (torch.cuda.memory_allocated(device) - base) / 2**30 if device.type == "cuda" else 0.0
    inputs = make_inputs(config, video, device)
    gen = torch.Generator().manual_seed(2)
    control = torch.randn(1, config.vace_in_channels, *inputs.latents.shape[2:], generator=gen)
    control = control.to(device, torch.bfloat16)
    scales = torch.ones(len(config.vace_layers), device=device, dtype=torch.bfloat16)
    attention = select_attention(
        "auto", device=device, dtype=torch.bfloat16, head_dim=config.attention_head_dim
    )
    metadata = model.build_attention_metadata(None, text_len=inputs.text.shape[1])

    @torch.no_grad()
    def diffusers_step() -> torch.Tensor:
        cond, uncond = (
            reference(
                hidden_states=inputs.latents[row : row + 1],
                timestep=inputs.timestep[row : row + 1],
                encoder_hidden_states=inputs.text[row : row + 1],
                control_hidden_states=control,
                control_hidden_states_scale=scales,
                return_dict=False,
            )[0]
            for row in (0, 1)
        )
        return uncond + GUIDANCE * (cond - uncond)

    @torch.no_grad()
    def mmgen_step() -> torch.Tensor:
        out = model(
            inputs.latents,
            inputs.timestep,
            inputs.text,
            attention=attention,
            control=control.expand(2, -1, -1, -1, -1),
            control_scale=1.0,
            metadata=metadata,
            control_metadata=metadata,
        )
        cond, uncond = out.chunk(2)
        return uncond + GUIDANCE * (cond - uncond)

    rows, results = [], {}
    for name, step in (
        ("diffusers (2 x batch 1)", diffusers_step),
        (f"mmgen batch 2 ({attention.provider})", mmgen_step),
    ):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        out, first, times = timed(step, device, warmup=args.warmup, iters=args.iters)
        peak = (torch.cuda.max_memory_allocated(device) - before) / 2**30 if device.type == "cuda" else 0.0
        results[name] = (out.float(), statistics.median(times))
        rows.append((name, statistics.median(times), peak, first))
        del out
    reference_out, reference_ms = next(iter(results.values()))
    table = []
    for name, ms, peak, first in rows:
        out = results[name][0]
        table.append(
            (
                name,
                f"{ms:.1f}",
                f"{reference_ms / ms:.2f}x",
                f"{peak:.2f}",
                f"{first:.1f}",
                f"{max_abs(out, reference_out):.3g}",
                f"{relative_error(out, reference_out):.3g}",
            )
        )
    print(
        f"Wan2.1-VACE {'tiny' if args.tiny else '14B'}, {video[0]}x{video[1]}x{video[2]}, "
        f"{inputs.tokens} tokens, {len(config.vace_layers)} VACE blocks, weights {weights:.1f} GiB"
    )
    columns = [
        ("row", 28),
        ("ms/step", 9),
        ("vs diffusers", 12),
        ("peak GiB", 9),
        ("first s", 8),
        ("max abs", 9),
        ("rel L2", 9),
    ]
    print_table(columns, table)


if __name__ == "__main__":
    main()
