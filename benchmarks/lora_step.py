"""What LoRAs cost per step (unfused / fused, rank 32 and 128), to fuse and unfuse, and what the 4-step
distillation preset saves end to end. Random bf16 weights, one GPU.

    python3 benchmarks/lora_step.py                    # Wan2.1-1.3B, 480x832x81
    python3 benchmarks/lora_step.py --model 14b --no-e2e   # Wan2.1-14B, 720x1280x81: step table
    python3 benchmarks/lora_step.py --model 14b --no-steps # its end-to-end table (50-step run extrapolated)
    python3 benchmarks/lora_step.py --tiny             # CPU smoke run of the harness

Step table: one CFG step (batch 2, cond + uncond) of mmgen's WanDiT with stacked q/k/v
(fuse_projections, the compiled path's layout; eager here), attention 'auto'; rows: no LoRA, and a
LoRA on every block Linear (self/cross-attention q, k, v, o and both FFN layers, as the lightx2v
distillation LoRAs cover) at rank 32 and 128, unfused (LowRankLinear beside the weight) and fused
(merged into it). ms = median of --iters CUDA-event timings after --warmup calls; overhead is
against the no-LoRA row (targets: <= 3% unfused at rank 32, 0 fused). Fuse / unfuse seconds:
apply_loras(mode='fused') including the copy of the originals to host memory, and remove().

End-to-end table (--e2e, on by default): pipelines.denoise over the DiT with text embeddings at
hand, i.e. everything between the text encoder and the VAE: the distill-4step preset (4 steps,
FlowMatch Euler shift 5, no CFG: batch 1) with a fused rank-64 LoRA, against UniPC with --cfg-steps
steps of CFG 5 (batch 2). Text encoding (~50 ms) and VAE decode (bf16 480p 1.8 s, 720p 4.2 s, see
/work/shared/GPU.md) are the same for both and are not included. With --cfg-run fewer than
--cfg-steps, the CFG run's time is extrapolated from the steps it ran (marked in the table).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from mmgen.attention import select_attention  # noqa: E402
from mmgen.lora import LoRARequest, apply_loras, parse_lora  # noqa: E402
from mmgen.lora.readers import LoRAFile  # noqa: E402
from mmgen.models.wan import WanConfig, WanDiT  # noqa: E402
from mmgen.parallel.layout import ParallelLayout  # noqa: E402
from mmgen.progress import NullProgress  # noqa: E402
from pipelines.denoise import (  # noqa: E402  # noqa: E402
    Conditioning,
    DenoiseModels,
    ResidentPlacement,
    TextBranch,
    denoise,
    plan_steps,
    split_branches,
)
from pipelines.presets import PRESETS  # noqa: E402

MODELS = {
    "1.3b": (WanConfig.wan21_t2v_1_3b(), (480, 832, 81), 3.0),
    "14b": (WanConfig.wan21_t2v_14b(), (720, 1280, 81), 5.0),
    "tiny": (
        WanConfig(num_attention_heads=2, attention_head_dim=32, ffn_dim=128, num_layers=2, text_len=16),
        (64, 64, 5),
        3.0,
    ),
}
LINEARS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0") + (
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2",
)  # fmt: skip


def build_model(config: WanConfig, device: torch.device) -> WanDiT:
    """Random bf16 WanDiT on `device` (fp32 where diffusers keeps it), allocated once, q/k/v stacked."""
    with torch.device("meta"):
        model = WanDiT(config)
    model = model.to(torch.bfloat16).to_empty(device=device)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if WanDiT.keeps_fp32(name):
                param.data = param.data.float()
            if name.endswith("norm_q.weight") or name.endswith("norm_k.weight") or ".norm2." in name:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif param.dim() > 1:
                param.normal_(0.0, param.shape[-1] ** -0.5 if param.dim() == 2 else 0.02, generator=gen)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model.eval().fuse_projections()


def synthetic_lora(model: WanDiT, rank: int, device: torch.device) -> LoRAFile:
    """A diffusers-format LoRA of `rank` on every block Linear (bf16 on the device), read like a file."""
    gen = torch.Generator(device).manual_seed(rank)
    params = dict(model.named_parameters())
    state = {}
    for index in range(model.config.num_layers):
        for layer in LINEARS:
            out_dim, in_dim = params[f"blocks.{index}.{layer}.weight"].shape
            prefix = f"transformer.blocks.{index}.{layer}"
            kw = dict(device=device, dtype=torch.bfloat16, generator=gen)
            state[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_dim, **kw) * in_dim**-0.5
            state[f"{prefix}.lora_B.weight"] = torch.randn(out_dim, rank, **kw) * 0.01
    return LoRAFile(Path(f"rank{rank}"), f"synthetic-rank-{rank}", parse_lora(state, source=f"rank{rank}"))


def inputs(config: WanConfig, size: tuple[int, int, int], batch: int, device: torch.device):
    height, width, frames = size
    gen = torch.Generator(device).manual_seed(1)
    latents = torch.randn(
        batch,
        config.in_channels,
        (frames - 1) // 4 + 1,
        height // 8,
        width // 8,
        device=device,
        generator=gen,
    )
    text = torch.randn(batch, config.text_len, config.text_dim, device=device, generator=gen)
    return latents, torch.full((batch,), 700.0, device=device), text.to(torch.bfloat16)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(model, attention, x, device, warmup: int, iters: int) -> float:
    """Median ms of model(*x) over iters calls (CUDA events on a GPU, perf_counter elsewhere)."""
    times = []
    with torch.no_grad():
        for index in range(warmup + iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                model(*x, attention=attention)
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end)
            else:
                tick = time.perf_counter()
                model(*x, attention=attention)
                elapsed = (time.perf_counter() - tick) * 1e3
            if index >= warmup:
                times.append(elapsed)
    return statistics.median(times)


def step_table(model, attention, config, size, device, args) -> None:
    x = inputs(config, size, 2, device)
    base = time_step(model, attention, x, device, args.warmup, args.iters)
    print("\n| LoRA | mode | ms / CFG step | overhead | fuse s | unfuse s |\n|---|---|---|---|---|---|")
    print(f"| none | - | {base:.1f} | - | - | - |")
    for rank in args.ranks:
        lora = synthetic_lora(model, rank, device)
        request = LoRARequest(lora.path, 1.0)
        for mode in ("unfused", "fused"):
            sync(device)
            tick = time.perf_counter()
            applied = apply_loras([model], [(request, lora)], mode=mode)
            sync(device)
            fuse = time.perf_counter() - tick
            ms = time_step(model, attention, x, device, args.warmup, args.iters)
            tick = time.perf_counter()
            applied.remove()
            sync(device)
            unfuse = time.perf_counter() - tick
            over = 100.0 * (ms / base - 1.0)
            print(f"| rank {rank} | {mode} | {ms:.1f} | {over:+.2f}% | {fuse:.3f} | {unfuse:.3f} |")
        del lora


def run_loop(model, attention, config, size, device, scheduler, guidance: float) -> float:
    """Seconds of pipelines.denoise with this scheduler (timesteps set) at this guidance scale."""
    batch = 2 if guidance > 1.0 else 1
    latents, _, text = inputs(config, size, batch, device)
    metadata = model.build_attention_metadata()
    both = TextBranch(text=text, metadata=metadata)
    conditioning = Conditioning(
        both=both, halves=split_branches(both, lambda row: metadata) if batch == 2 else ()
    )
    models = DenoiseModels(
        experts=(model,),
        attention=attention,
        layout=ParallelLayout.single(),
        placement=ResidentPlacement(),
        dtype=torch.bfloat16,
    )
    scheduler.set_begin_index(0)
    steps = plan_steps(scheduler.timesteps, (guidance,))
    sync(device)
    tick = time.perf_counter()
    with torch.no_grad():
        denoise(latents[:1].float(), steps, scheduler, conditioning, models, progress=NullProgress())
    sync(device)
    return time.perf_counter() - tick


def e2e_table(model, attention, config, size, shift, device, args) -> None:
    from diffusers import UniPCMultistepScheduler

    lora = synthetic_lora(model, 64, device)
    applied = apply_loras([model], [(LoRARequest(lora.path, 1.0), lora)], mode="fused")
    preset = PRESETS["distill-4step"]
    run_loop(model, attention, config, size, device, preset.scheduler(device), 1.0)  # warm-up
    fast = run_loop(model, attention, config, size, device, preset.scheduler(device), 1.0)
    applied.remove()
    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift)
    unipc.set_timesteps(args.cfg_steps, device=device)
    ran = min(args.cfg_run, args.cfg_steps)
    unipc.timesteps = unipc.timesteps[:ran]  # plan only the steps that run (time scales per step)
    slow = run_loop(model, attention, config, size, device, unipc, 5.0) * args.cfg_steps / ran
    mark = "" if ran == args.cfg_steps else f" (extrapolated from {ran} steps)"
    print("\n| run | DiT calls | batch | denoise s | speed-up |\n|---|---|---|---|---|")
    print(f"| {args.cfg_steps}-step UniPC, CFG 5{mark} | {args.cfg_steps} | 2 | {slow:.2f} | 1.00x |")
    print(f"| distill-4step + fused rank-64 LoRA | 4 | 1 | {fast:.2f} | {slow / fast:.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("1.3b", "14b"), default="1.3b")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run of the harness (tiny config)")
    parser.add_argument("--ranks", type=lambda s: [int(r) for r in s.split(",")], default=[32, 128])
    parser.add_argument("--warmup", type=int, default=None, help="default 3 (14b: 1)")
    parser.add_argument("--iters", type=int, default=None, help="default 10 (14b: 3)")
    parser.add_argument("--no-e2e", dest="e2e", action="store_false", help="skip the end-to-end table")
    parser.add_argument("--no-steps", dest="steps", action="store_false", help="skip the step table")
    parser.add_argument("--cfg-steps", type=int, default=50)
    parser.add_argument("--cfg-run", type=int, default=None, help="steps of the CFG run actually timed")
    args = parser.parse_args()
    name = "tiny" if args.tiny else args.model
    config, size, shift = MODELS[name]
    if args.cfg_run is None:
        args.cfg_run = 5 if name == "14b" else args.cfg_steps
    # A 14B 720p CFG step takes ~20 s: fewer timed calls keep each table within a 10-minute run.
    args.warmup = args.warmup if args.warmup is not None else (1 if name == "14b" else 3)
    args.iters = args.iters if args.iters is not None else (3 if name == "14b" else 10)
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:
        args.warmup, args.iters = 1, 2
    model = build_model(config, device)
    attention = select_attention(
        "auto", device=device, dtype=torch.bfloat16, head_dim=config.attention_head_dim
    )
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"model {name} ({config.num_layers} layers, dim {config.dim}), video {size[0]}x{size[1]}x{size[2]}, "
        f"bf16, attention {attention.name}:{attention.provider}, {gpu}, torch {torch.__version__}"
    )
    if args.steps:
        step_table(model, attention, config, size, device, args)
    if args.e2e:
        e2e_table(model, attention, config, size, shift, device, args)


if __name__ == "__main__":
    main()
