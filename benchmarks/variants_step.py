"""One denoising step of the Wan2.1 I2V / Wan2.2 variants: mmgen against diffusers, same random bf16 weights.

Run from the repository root on a CUDA machine with diffusers (see /work/shared/GPU.md for .gpu/):

    python3 benchmarks/variants_step.py                    # all three cases below
    python3 benchmarks/variants_step.py --case ti2v-5b     # one case
    python3 benchmarks/variants_step.py --compile          # add mmgen rows with compile_blocks()
    python3 benchmarks/variants_step.py --tiny             # CPU smoke run of the harness

Cases (the DiT input a real request makes; one guided step = cond + uncond):
  i2v-14b   Wan2.1 I2V-14B, 480x832x81: latents [1, 36, 21, 60, 104] (noise + mask + image latents),
            257 CLIP tokens of width 1280 attended in every cross-attention.
  ti2v-5b   Wan2.2 TI2V-5B, 704x1280x121 (Wan2.2 VAE: 16x space, z 48): latents [1, 48, 31, 44, 80],
            per-token timesteps (first latent frame at 0).
  a14b      Wan2.2 T2V-A14B, 720x1280x81: one step of each expert (high-noise, then low-noise); peak
            memory with both experts resident, and with the idle one parked on the CPU (the
            measurement only: moving experts is the placement's job, not this script's).

Rows: mmgen (one batch-2 call, attention 'auto'), optionally compiled, and diffusers'
WanTransformer3DModel called as its pipelines do (two batch-1 calls, default attention). Printed:
ms per step (median of --iters after one warm-up, CUDA events), the ratio to diffusers, the peak
GPU memory above the resident weights, and max abs difference of the guided prediction vs diffusers.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from mmgen.attention import select_attention  # noqa: E402
from mmgen.models.wan import WanConfig, WanDiT  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    config: WanConfig
    latents: tuple[int, int, int, int, int]  # [1, C_in, F', H', W']
    experts: int = 1
    image_tokens: int = 0
    per_token: bool = False


CASES = {
    "i2v-14b": Case("i2v-14b", WanConfig.wan21_i2v_14b(), (1, 36, 21, 60, 104), image_tokens=257),
    "ti2v-5b": Case("ti2v-5b", WanConfig.wan22_ti2v_5b(), (1, 48, 31, 44, 80), per_token=True),
    "a14b": Case("a14b", WanConfig.wan22_t2v_a14b(), (1, 16, 21, 90, 160), experts=2),
}
TINY = {
    name: Case(
        name,
        WanConfig(
            num_attention_heads=2,
            attention_head_dim=64,
            in_channels=case.config.in_channels,
            out_channels=case.config.out_channels,
            ffn_dim=256,
            num_layers=2,
            text_dim=4096,
            image_dim=case.config.image_dim,
            added_kv_proj_dim=None if case.config.image_dim is None else 128,
        ),
        (1, case.latents[1], 3, 8, 12),
        case.experts,
        case.image_tokens,
        case.per_token,
    )
    for name, case in CASES.items()
}


def build_pair(config: WanConfig, device: str, seed: int) -> tuple[torch.nn.Module, WanDiT]:
    """diffusers' model with random weights (bf16, its fp32 modules kept fp32) and mmgen's sharing them.

    Built on the meta device and allocated once on `device` in its final dtype (a 14B model never
    exists in float32), then filled: norm scales near 1, small biases, weights ~ N(0, 1 / fan_in).
    """
    from diffusers import WanTransformer3DModel

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device("meta"):
        reference = WanTransformer3DModel(**config.to_diffusers_config())
    reference = reference.to_empty(device=device).eval()
    # to_empty leaves buffers uninitialized: rebuild the RoPE tables (diffusers' only buffers).
    reference.rope = type(reference.rope)(
        config.attention_head_dim, config.patch_size, config.rope_max_seq_len
    ).to(device)
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            keep = WanDiT.keeps_fp32(name)
            values = torch.randn(param.shape, generator=gen, device=device)
            if name.endswith("bias"):
                values *= 0.02
            elif param.dim() == 1 or "scale_shift_table" in name:
                values = 1.0 + 0.05 * values if param.dim() == 1 else values / param.shape[-1] ** 0.5
            else:
                values /= max(1, param[0].numel()) ** 0.5
            param.data = values.to(torch.float32 if keep else dtype)
            del values
    with torch.device("meta"):
        ours = WanDiT(config)
    ours.load_state_dict(reference.state_dict(), assign=True, strict=True)  # the same tensors, no copy
    return reference.requires_grad_(False), ours.eval().requires_grad_(False)


def inputs(case: Case, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device).manual_seed(0)
    latents = torch.randn(case.latents, generator=gen, device=device).to(dtype)
    text = torch.randn(2, 512, case.config.text_dim, generator=gen, device=device).to(dtype)
    _, _, frames, height, width = case.latents
    pt, ph, pw = case.config.patch_size
    tokens = (frames // pt) * (height // ph) * (width // pw)
    t = torch.tensor([757.0], device=device)
    if case.per_token:
        mask = torch.ones(frames // pt, height // ph, width // pw, device=device)
        mask[0] = 0
        timestep = (mask.flatten() * t).expand(2, tokens)
    else:
        timestep = t.expand(2)
    out = {"latents": latents.expand(2, -1, -1, -1, -1), "text": text, "timestep": timestep}
    if case.image_tokens:
        image = torch.randn(1, case.image_tokens, case.config.image_dim, generator=gen, device=device)
        out["image"] = image.to(dtype).expand(2, -1, -1)
    return out


def guided(pred: torch.Tensor) -> torch.Tensor:
    cond, uncond = pred.float().chunk(2)
    return uncond + 5.0 * (cond - uncond)


def run_mmgen(model: WanDiT, x: dict, attention) -> torch.Tensor:
    extra = {"image_embeds": x["image"]} if "image" in x else {}
    out = model(x["latents"], x["timestep"], x["text"], attention=attention, **extra)
    return guided(out)


def run_diffusers(model, x: dict) -> torch.Tensor:
    outs = []
    for row in range(2):  # as WanPipeline / WanImageToVideoPipeline call it: cond, then uncond
        extra = {"encoder_hidden_states_image": x["image"][row : row + 1]} if "image" in x else {}
        outs.append(
            model(
                x["latents"][row : row + 1],
                x["timestep"][row : row + 1],
                x["text"][row : row + 1],
                return_dict=False,
                **extra,
            )[0]
        )
    return guided(torch.cat(outs))


def timed(fn: Callable[[], torch.Tensor], iters: int, device: str) -> tuple[float, float, torch.Tensor]:
    """(median ms, peak bytes above the memory in use before, output) after one warm-up call."""
    out = fn()
    if device != "cuda":
        return float("nan"), float("nan"), out
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated() - base, out


def bench_case(case: Case, device: str, iters: int, compile_rows: bool) -> list[tuple]:
    rows = []
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pairs = [build_pair(case.config, device, seed) for seed in range(case.experts)]
    x = inputs(case, device, dtype)
    attention = select_attention("auto", device=torch.device(device), dtype=dtype, head_dim=128)
    for index, (reference, ours) in enumerate(pairs):
        label = case.name if case.experts == 1 else f"{case.name} expert {index}"
        ref_ms, ref_peak, ref_out = timed(lambda r=reference: run_diffusers(r, x), iters, device)
        rows.append((label, "diffusers (2 x batch 1)", ref_ms, ref_peak, 0.0))
        variants = [("mmgen eager", ours)]
        if compile_rows:
            variants.append(("mmgen compiled", None))
        for name, model in variants:
            if model is None:
                ours.compile_blocks()
                model = ours
            ms, peak, out = timed(lambda m=model: run_mmgen(m, x, attention), iters, device)
            rows.append(
                (label, f"{name} ({attention.name}:{attention.provider})", ms, peak, _err(out, ref_out))
            )
    if case.experts == 2 and device == "cuda":
        rows.extend(_parked_peaks(case, pairs, x, attention))
    del pairs
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def _parked_peaks(case: Case, pairs, x, attention) -> list[tuple]:
    """Peak GPU memory of a two-expert step pair: both resident vs the idle expert on the CPU."""
    out = []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _, ours in pairs:
        run_mmgen(ours, x, attention)
    torch.cuda.synchronize()
    out.append(
        (
            case.name,
            "mmgen both experts resident: peak total",
            float("nan"),
            torch.cuda.max_memory_allocated(),
            None,
        )
    )
    for reference, _ in pairs[1:]:
        reference.to("cpu")  # the shared tensors: mmgen's expert 1 is parked with it
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    run_mmgen(pairs[0][1], x, attention)
    torch.cuda.synchronize()
    out.append(
        (
            case.name,
            "mmgen idle expert on CPU: peak total",
            float("nan"),
            torch.cuda.max_memory_allocated(),
            None,
        )
    )
    return out


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), action="append", help="default: all")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="add mmgen rows with compile_blocks()")
    parser.add_argument("--tiny", action="store_true", help="tiny configs on the CPU (harness smoke run)")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --tiny for a CPU smoke run")
        return 1
    table = TINY if args.tiny else CASES
    print(f"{'case':<20} {'row':<48} {'ms':>9} {'x diffusers':>11} {'peak GiB':>9} {'max abs':>9}")
    for name in args.case or sorted(table):
        rows = bench_case(table[name], device, args.iters, args.compile)
        reference_ms = {row[0]: row[2] for row in rows if row[1].startswith("diffusers")}
        for label, row, ms, peak, err in rows:
            ratio = reference_ms.get(label, float("nan")) / ms if ms == ms and ms > 0 else float("nan")
            error = "" if err is None else f"{err:.3g}"
            print(f"{label:<20} {row:<48} {ms:9.1f} {ratio:11.2f} {peak / 2**30:9.2f} {error:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
