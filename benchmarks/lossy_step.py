"""Step caching and CFG truncation (issue 20): denoise-loop speed-up and the error each one costs.

Run from the repository root on a CUDA machine (bundles as in /work/shared/GPU.md; diffusers is
needed only to build the random weights, as every DiT benchmark does):

    python3 benchmarks/lossy_step.py                      # Wan2.1-1.3B, 480x832x81, 50 steps, CFG 5
    python3 benchmarks/lossy_step.py --model 14b --steps 20
    python3 benchmarks/lossy_step.py --tiny --steps 8     # CPU smoke run of the harness
    python3 benchmarks/lossy_step.py --fp8-step           # one CFG step, FP8 linear layers on vs off
    python3 benchmarks/lossy_step.py --model 14b --fp8-step --fp8-short --iters 1   # 4 rows at 14B 720p
    python3 benchmarks/lossy_step.py --model 1.3b --steps 20 --no-compile --presets   # the presets (~100 s)

--presets runs only lossless, FP8 alone (linears of the kinds fp8_layers_for picks for the model's
width + FP8 attention), `fast` and `fastest` as they ship (their caching and truncation plus FP8,
applied as the pipeline applies them on an FP8 GPU; on the CPU --tiny run the FP8 parts run
emulated, only to exercise the harness). Their error columns count caching and truncation only
(the per-step error is along the lossless trajectory); the final-latents error includes FP8.

--fp8-step times one CFG step (the DiT at batch 2, eager, q/k/v stacked) with the bf16 linears and
with FP8 linear layers (mmgen.layers.fp8_linear): the default kinds, all kinds, and each kind alone;
then FP8 self-attention (mmgen.attention.fp8, needs FA3) alone and with the default linears; and
prints each row's ms, speed-up and the relative error of the DiT output against the bf16 step.

The loop is mmgen's own (pipelines.denoise.denoise) on the DiT with random bf16 weights, random text
embeddings [2, 512, 4096] (cond, uncond) and the Wan2.1 UniPC schedule (flow shift 3); text encoder
and VAE are not run (their seconds are the same for every setting). Each setting: one untimed
2-step warm-up loop, then the timed loop. Printed per setting: the DiT batch rows run (2 per guided
step, 1 per truncated step, 0 per cached step), the loop's seconds and speed-up over lossless, the
relative error of the final latents against lossless, and the per-step relative error of the
guided DiT output: along the lossless trajectory, what the setting would feed the scheduler at each
step (a cached step's stored outputs, a truncated step's conditional output) against the true
guided output (mean and max over steps). Random weights: the errors say how far each setting moves
the numbers, not how the pictures look (the default model's `mmgen ab` ledger says that).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from bench_utils import (  # noqa: E402
    bench_device,
    device_name,
    environment_header,
    print_table,
    relative_error,
    synchronize,
    versions,
    write_json,
)
from wan_models import add_model_args, build_models, model_and_video  # noqa: E402

from mmgen.models.settings import ExecutionSettings  # noqa: E402
from pipelines.step_cache import ACCEL_PRESETS  # noqa: E402

# (label, step_cache, cfg_truncation): lossless first (the reference), then each option, then the
# presets' caching + truncation (without their FP8 parts: --presets runs those).
SETTINGS = (
    ("lossless", None, None),
    ("step_cache=1.0", 1.0, None),
    ("step_cache=1.5", 1.5, None),
    ("step_cache=2.5", 2.5, None),
    ("cfg_truncation=0.8", None, 0.8),
    ("cfg_truncation=0.6", None, 0.6),
    ("fast w/o fp8", "fast", None),
    ("fastest w/o fp8", "fastest", None),
)
# --presets: (label, step_cache or accel name, cfg_truncation, FP8 linears, FP8 attention)
PRESET_SETTINGS = (
    ("lossless", None, None, False, False),
    ("fp8 linear+attention", None, None, True, True),
    *((name, name, None, p.fp8_linear, p.fp8_attention) for name, p in ACCEL_PRESETS.items()),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--steps", type=int, default=50, help="denoising steps")
    parser.add_argument("--attention", default="auto", help="mmgen attention backend (BACKEND_NAMES)")
    parser.add_argument("--no-compile", action="store_true", help="run the DiT blocks eagerly")
    parser.add_argument("--json", type=Path, help="also write every number to this JSON file")
    parser.add_argument("--fp8-step", action="store_true", help="time one CFG step, FP8 linears on vs off")
    parser.add_argument(
        "--presets",
        action="store_true",
        help="the loop lossless vs FP8 vs fast vs fastest as shipped (with FP8)",
    )
    parser.add_argument(
        "--fp8-short",
        action="store_true",
        help="--fp8-step: only bf16, the width's FP8 linears, FP8 attention and both (not each kind alone)",
    )
    parser.add_argument("--iters", type=int, default=3, help="--fp8-step: timed steps per row")
    parser.add_argument("--warmup", type=int, default=1, help="--fp8-step: untimed steps per row")
    return parser.parse_args()


def step_inputs(args: argparse.Namespace, device: torch.device) -> tuple:
    """(config, (height, width, frames), mmgen's WanDiT with random weights, attention impl, the seeded
    generator the mode then draws its latents and text from) for both modes."""
    from mmgen.attention import select_attention

    config, video = model_and_video(args)
    reference, model = build_models(config, device)
    del reference
    attention = select_attention(
        args.attention if device.type == "cuda" else "sdpa",
        device=device,
        dtype=model.dtype,
        head_dim=config.attention_head_dim,
    )
    return config, video, model, attention, torch.Generator().manual_seed(5)


def fp8_step(args: argparse.Namespace, device: torch.device) -> None:
    """One CFG step of the DiT with FP8 linear layers (each setting) against bf16: ms, speed-up, error."""
    from mmgen.layers.fp8_linear import FP8_LAYER_KINDS, fp8_layers_for

    config, video, model, attention, generator = step_inputs(args, device)
    model.fuse_projections()
    default_kinds = fp8_layers_for(config.dim)
    # (label, FP8 linear kinds, FP8 self-attention)
    settings = [("bf16", None, False), ("fp8 default", default_kinds, False)]
    if not args.fp8_short:
        settings += [("fp8 all", frozenset(FP8_LAYER_KINDS), False)]
        settings += [(f"fp8 {kind} only", frozenset({kind}), False) for kind in FP8_LAYER_KINDS]
    settings += [("fp8 attention", None, True), ("fp8 default + attention", default_kinds, True)]
    rows, results = step_table(
        model, video, attention, device, settings, generator, warmup=args.warmup, iters=args.iters
    )
    height, width, frames = video
    print("\n" + environment_header(device))
    print(
        f"one CFG step (DiT batch 2, eager, q/k/v stacked) {height}x{width}x{frames}, attention "
        f"{attention.name}:{attention.provider}; error = relative L2 of the DiT output vs the bf16 step"
    )
    print_table(STEP_COLUMNS, rows)
    write_json(
        args.json,
        {
            "device": device_name(device),
            "versions": versions(),
            "video": [height, width, frames],
            "rows": results,
        },
    )


STEP_COLUMNS = [("setting", 22), ("step_ms", 9), ("speedup", 8), ("rel_error", 10)]


def step_table(
    model,
    video,
    attention,
    device: torch.device,
    settings,
    generator: torch.Generator,
    *,
    warmup: int,
    iters: int,
) -> tuple[list[tuple], list[dict]]:
    """Time one CFG step (the DiT at batch 2, random latents and text, t = 500) per setting.

    settings: (label, FP8 linear kinds or None, FP8 self-attention); the first is the reference the
    speed-up and the relative L2 error of the DiT output are taken against. Returns (table rows,
    JSON rows); a setting that fails (e.g. no FA3 for FP8 attention) gets a row saying why. The
    model is left with FP8 off.
    """
    import statistics

    from bench_utils import one_line, timed

    config = model.config
    height, width, frames = video
    latents_shape = (2, config.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8)
    latents = torch.randn(latents_shape, generator=generator).to(device, model.dtype)
    text = torch.randn(2, config.text_len, config.text_dim, generator=generator).to(device, model.dtype)
    timestep = torch.full((2,), 500.0, device=device)
    metadata = model.build_attention_metadata(None, text_len=config.text_len)
    rows, results, exact, base_ms = [], [], None, None
    try:
        for label, kinds, fp8_attention in settings:
            chosen = ExecutionSettings(fp8_layers=frozenset(kinds or ()), fp8_attention=fp8_attention)

            def step(chosen: ExecutionSettings = chosen) -> torch.Tensor:
                with torch.no_grad():
                    return model(
                        latents, timestep, text, attention=attention, metadata=metadata, settings=chosen
                    )

            try:
                if warmup > 0:
                    out, _, times = timed(step, device, warmup=warmup, iters=iters)
                else:  # kernels already warm (e.g. after whole-pipeline runs): every call is timed
                    out, times = _cold_calls(step, device, iters)
            except Exception as err:  # noqa: BLE001 - e.g. no FA3 for FP8 attention: the row says so
                rows.append((label, None, None, one_line(err)[:60]))
                continue
            ms = statistics.median(times)
            if exact is None:
                exact, base_ms = out, ms
            error = relative_error(out, exact)
            results.append(
                {
                    "setting": label,
                    "kinds": sorted(kinds or ()),
                    "fp8_attention": fp8_attention,
                    "ms": ms,
                    "rel_error": error,
                }
            )
            rows.append((label, f"{ms:.1f}", f"{base_ms / ms:.3f}x", f"{error:.2e}"))
            del out
    except KeyboardInterrupt:
        print("interrupted: the rows measured so far")
    return rows, results


def _cold_calls(step, device: torch.device, iters: int) -> tuple:
    """(last output, [ms of each call]) with no untimed call first (wall clock, synchronized)."""
    out, times = None, []
    for _ in range(iters):
        synchronize(device)
        tick = time.perf_counter()
        out = step()
        synchronize(device)
        times.append((time.perf_counter() - tick) * 1e3)
    return out, times


class Recorder:
    """Wraps the DiT: keeps every call's output (the lossless run's per-step branch outputs)."""

    def __init__(self, model) -> None:
        self.model, self.outputs = model, []
        self.config, self.condition_embedder = model.config, model.condition_embedder

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        self.outputs.append(out)
        return out


def options_for(step_cache, cfg_truncation):
    from pipelines.denoise import DenoiseOptions

    if isinstance(step_cache, str):
        preset = ACCEL_PRESETS[step_cache]
        return DenoiseOptions(step_cache=preset.step_cache, cfg_truncation=preset.cfg_truncation)
    return DenoiseOptions(step_cache=step_cache, cfg_truncation=cfg_truncation)


def main() -> None:
    args = parse_args()
    device = bench_device(args.tiny)
    if args.fp8_step:
        fp8_step(args, device)
        return
    from mmgen.layers.fp8_linear import fp8_layers_for
    from mmgen.parallel.layout import ParallelLayout
    from mmgen.progress import NullProgress
    from pipelines.denoise import (
        Conditioning,
        DenoiseModels,
        ResidentPlacement,
        TextBranch,
        denoise,
        guide,
        plan_steps,
        split_branches,
        step_reuse,
    )
    from pipelines.step_cache import guided_steps

    settings = PRESET_SETTINGS if args.presets else tuple((*row, False, False) for row in SETTINGS)
    config, (height, width, frames), model, attention, generator = step_inputs(args, device)
    if not args.no_compile and device.type == "cuda":
        model.compile_blocks()
    text = torch.randn(2, config.text_len, config.text_dim, generator=generator).to(device, model.dtype)

    def metadata(rows: int):
        return model.build_attention_metadata(None, text_len=config.text_len)

    both = TextBranch(text=text, metadata=metadata(2))
    conditioning = Conditioning(both=both, halves=split_branches(both, lambda row: metadata(1)))
    latents_shape = (1, config.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8)
    noise = torch.randn(latents_shape, generator=generator).to(device)

    def schedule(steps: int):
        from diffusers import UniPCMultistepScheduler

        scheduler = UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        )
        scheduler.set_timesteps(steps, device=device)
        scheduler.set_begin_index(0)
        return scheduler, plan_steps(scheduler.timesteps, (5.0,))

    def run(expert, options, steps: int, chosen: ExecutionSettings) -> tuple[torch.Tensor, float]:
        scheduler, plan = schedule(steps)
        models = DenoiseModels(
            (expert,), attention, ParallelLayout.single(), ResidentPlacement(), model.dtype, chosen
        )
        synchronize(device)
        tick = time.perf_counter()
        with torch.no_grad():
            out = denoise(
                noise, plan, scheduler, conditioning, models, options=options, progress=NullProgress()
            )
        synchronize(device)
        return out, time.perf_counter() - tick

    _, plan = schedule(args.steps)
    single = DenoiseModels((model,), attention, ParallelLayout.single(), ResidentPlacement(), model.dtype)
    rows, results = [], []
    exact = exact_s = recorded = None
    try:
        for label, step_cache, cfg_truncation, fp8_linear, fp8_attention in settings:
            options = options_for(step_cache, cfg_truncation)
            kinds = fp8_layers_for(config.dim) if fp8_linear else frozenset()
            chosen = ExecutionSettings(fp8_layers=kinds, fp8_attention=bool(fp8_attention))
            run(model, options, 2, chosen)  # warm-up: compile, kernel selection, caches
            if label == "lossless":
                recorder = Recorder(model)
                exact, exact_s = run(recorder, options, args.steps, chosen)
                recorded = [tuple(out.chunk(2)) for out in recorder.outputs]  # (cond, uncond) per step
                del recorder
                final, seconds = exact, exact_s
            else:
                final, seconds = run(model, options, args.steps, chosen)
            reuse = step_reuse(plan, single, options)
            keep = guided_steps(options.cfg_truncation, args.steps)
            batch_rows = sum(0 if reuse[i] else (2 if i < keep else 1) for i in range(args.steps))
            step_errors, source = [], 0
            for i, step in enumerate(plan):
                source = source if reuse[i] else i  # a cached step feeds the last computed step's outputs
                used = recorded[source] if i < keep else recorded[source][:1]
                step_errors.append(
                    relative_error(guide(used, step.guidance_scale), guide(recorded[i], step.guidance_scale))
                )
            row = {
                "setting": label,
                "fp8_linear_layers": sorted(kinds),
                "fp8_attention": fp8_attention,
                "step_cache": options.step_cache,
                "cfg_truncation": options.cfg_truncation,
                "cached_steps": [i for i, r in enumerate(reuse) if r],
                "dit_batch_rows": batch_rows,
                "loop_s": seconds,
                "speedup": exact_s / seconds,
                "final_latents_rel_error": relative_error(final, exact),
                "step_rel_error_mean": sum(step_errors) / len(step_errors),
                "step_rel_error_max": max(step_errors),
            }
            results.append(row)
            rows.append(
                (
                    label,
                    f"{batch_rows}/{2 * args.steps}",
                    f"{seconds:.2f}",
                    f"{row['speedup']:.2f}x",
                    f"{row['final_latents_rel_error']:.4f}",
                    f"{row['step_rel_error_mean']:.4f}",
                    f"{row['step_rel_error_max']:.4f}",
                )
            )
    except KeyboardInterrupt:
        print("interrupted: the rows measured so far")
    print("\n" + environment_header(device))
    if args.presets:
        print(
            f"FP8 rows: linears {sorted(fp8_layers_for(config.dim))} (dim {config.dim}) + self-attention e4m3"
        )
    print(
        f"denoise loop {height}x{width}x{frames}, {args.steps} steps, CFG 5, attention {attention.name}:"
        f"{attention.provider}, compiled {model.blocks_compiled}"
    )
    print_table(
        [
            ("setting", 20),
            ("DiT rows", 9),
            ("loop_s", 8),
            ("speedup", 8),
            ("final_rel", 10),
            ("step_rel_mean", 13),
            ("step_rel_max", 12),
        ],
        rows,
    )
    write_json(
        args.json,
        {
            "device": device_name(device),
            "versions": versions(),
            "video": [height, width, frames],
            "steps": args.steps,
            "rows": results,
        },
    )


if __name__ == "__main__":
    main()
