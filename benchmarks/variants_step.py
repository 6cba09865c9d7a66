"""One denoising step of Wan2.1 I2V-14B, Wan2.2 TI2V-5B and Wan2.2 A14B: mmgen against diffusers, same weights.

Run from the repository root on a CUDA machine with the diffusers and fa3fwd bundles unpacked
(/work/shared/GPU.md; benchmarks/gpu_session.sh does it):

    python3 benchmarks/variants_step.py --case i2v-14b --case ti2v-5b   # ~75 s on an H100 (estimate)
    python3 benchmarks/variants_step.py --case ti2v-5b --torch-rows     # ~45 s on an H100 (estimate)
    python3 benchmarks/variants_step.py --case a14b                     # ~170 s on an H100 (estimate)
    python3 benchmarks/variants_step.py --estimate                      # the time estimates only, no GPU
    python3 benchmarks/variants_step.py --tiny                          # CPU dry run of every path

Cases (the DiT input a real request makes; one guided step = cond + uncond):
  i2v-14b   Wan2.1 I2V-14B-480P, 480x832x81: latents [1, 36, 21, 60, 104] (noise + mask + image
            latents) = 32,760 tokens; 257 CLIP tokens of width 1280 in every cross-attention.
  ti2v-5b   Wan2.2 TI2V-5B, 704x1280x121 (Wan2.2 VAE: 16x space, z 48): latents [1, 48, 31, 44, 80]
            = 27,280 tokens; per-token timesteps (the first latent frame's tokens at 0).
  a14b      Wan2.2 T2V-A14B, 720x1280x81: latents [1, 16, 21, 90, 160] = 75,600 tokens; one step of
            each expert (different random weights), then peak memory with both experts resident
            against the idle expert parked in pinned host memory by mmgen's OffloadPlacement
            ('model' offload with the expert prefetch, as the pipeline's memory plan uses it).

Weights: random bf16, built directly on the GPU by diffusers' WanTransformer3DModel (its fp32
modules fp32, as from_pretrained keeps them) and shared tensor for tensor with mmgen's WanDiT
(benchmarks/wan_models.py): a 14B model never exists on the CPU or twice on the GPU. Each case's
models are freed before the next case builds its own.

Rows: diffusers' default attention called as WanPipeline / WanImageToVideoPipeline call it (two
batch-1 calls: cond, then uncond) and mmgen as its pipeline calls it (one batch-2 call) with the
Wan2.1 path's speed techniques: FlashAttention-3 through fa3-fwd (else the first installed
provider, named in the row) and its Triton row kernels (on by default); --compile adds a row with
compile_blocks(), --torch-rows one with the row passes on the torch path (set_fused_kernels(False)).
Per-token cases (ti2v-5b) first print which row kernels one model call launches (counted on a
two-frame input): each block's three norms and the FFN residual must run as mmgen's Triton ops,
with the modulation read from a table of the distinct timesteps. Printed per row: ms per step (median of --iters after the warm-up), the ratio to
diffusers and to the floor, the peak GPU memory (all allocations, weights included), max abs and
relative L2 error of the guided prediction against diffusers'. The floor: attention FLOPs at the
fastest attention kernel measured here at the case's shape plus linear FLOPs at the measured
8192^3 bf16 matmul rate. Warm-up: one untimed call per row at full size, or with --warmup short
(the a14b default) one call on the first quarter of the latent frames, which loads and JIT-compiles
every kernel at a fraction of the cost (a 720p step takes ~20-27 s).

A time limit's SIGTERM prints the rows measured so far.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from bench_utils import (  # noqa: E402
    _timed_calls,  # noqa: E402  (CUDA-event timing without timed()'s first call)
    attention_peaks,
    bench_device,
    environment_header,
    floor_ms,
    matmul_peak,
    max_abs,
    one_line,
    relative_error,
)
from dit_step import dit_flops  # noqa: E402
from wan_models import TINY, build_models  # noqa: E402

from mmgen.attention import select_attention  # noqa: E402
from mmgen.attention.impls import AttentionImpl  # noqa: E402
from mmgen.kernels.fa_providers import probe_provider as load_provider  # noqa: E402
from mmgen.models.wan import WanConfig, WanDiT  # noqa: E402

GUIDANCE = 5.0
TIMESTEP = 757.0  # a high-noise timestep (>= the A14B boundary 875 is not needed: the expert is chosen here)
# Rates for --estimate and the printed time plan (GPU.md, H100): attention and GEMM TFLOP/s, and the
# measured step time over the floor of diffusers' default (I2V-14B: 6.75 s) and of mmgen (1.3B, FA3).
NOMINAL_ATTENTION_TFLOPS = 700.0
NOMINAL_GEMM_TFLOPS = 750.0
DIFFUSERS_OVER_FLOOR = 1.47
MMGEN_OVER_FLOOR = 1.14


@dataclass(frozen=True)
class Case:
    """A variant at its real size: the DiT config, the latents [1, C_in, F', H', W'] and what conditions it."""

    name: str
    config: WanConfig
    latents: tuple[int, int, int, int, int]
    video: str
    experts: int = 1
    image_tokens: int = 0  # CLIP tokens (Wan2.1 I2V)
    per_token: bool = False  # Wan2.2 TI2V: first latent frame at timestep 0
    warmup: str = "full"
    iters: int = 2

    @property
    def tokens(self) -> int:
        _, _, frames, height, width = self.latents
        pt, ph, pw = self.config.patch_size
        return (frames // pt) * (height // ph) * (width // pw)


CASES = {
    "i2v-14b": Case(
        "i2v-14b", WanConfig.wan21_i2v_14b(), (1, 36, 21, 60, 104), "480x832x81", image_tokens=257
    ),
    "ti2v-5b": Case(
        "ti2v-5b", WanConfig.wan22_ti2v_5b(), (1, 48, 31, 44, 80), "704x1280x121", per_token=True, iters=3
    ),
    "a14b": Case(
        "a14b",
        WanConfig.wan22_t2v_a14b(),
        (1, 16, 21, 90, 160),
        "720x1280x81",
        experts=2,
        warmup="short",
        iters=1,
    ),
}


def tiny_case(case: Case) -> Case:
    """The same case with wan_models' tiny DiT (its channels and image path kept) and a tiny video."""
    config = replace(TINY, in_channels=case.config.in_channels, out_channels=case.config.out_channels)
    if case.config.has_image_path:
        # diffusers' image cross-attention takes the last 512 context tokens as text: keep text_len 512
        config = replace(config, image_dim=32, added_kv_proj_dim=config.dim, text_len=512)
    return replace(
        case, config=config, latents=(1, case.latents[1], 5, 8, 12), image_tokens=min(case.image_tokens, 9)
    )


# ----------------------------------------------------------------------------------------------
# inputs and calls


def make_inputs(case: Case, device: torch.device, frames: int | None = None) -> dict[str, torch.Tensor]:
    """One CFG step's inputs, bf16 (fp32 timesteps): the same noise for both rows, two zero-padded prompts.

    latents [2, C, F', H', W'] (F' = `frames` when given: the short warm-up), timestep [2] or [2, S],
    text [2, L, text_dim], image [2, N, image_dim] when the case has CLIP tokens.
    """
    config = case.config
    shape = list(case.latents)
    if frames is not None:
        shape[2] = frames
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(shape, generator=gen).expand(2, -1, -1, -1, -1)
    text = torch.randn(2, config.text_len, config.text_dim, generator=gen)
    text[0, config.text_len // 8 :] = 0  # the prompt: 1/8 of the tokens valid, the rest zero padding
    text[1, config.text_len // 32 :] = 0  # the negative prompt: shorter
    out = {
        "latents": latents.to(device, torch.bfloat16),
        "text": text.to(device, torch.bfloat16),
        "timestep": torch.full((2,), TIMESTEP, device=device),
    }
    if case.per_token:  # diffusers' expand_timesteps: mask (0 on the first latent frame) * t, per token
        pt, ph, pw = config.patch_size
        grid = (shape[2] // pt, shape[3] // ph, shape[4] // pw)
        mask = torch.ones(grid, device=device)
        mask[0] = 0
        out["timestep"] = (mask.flatten() * TIMESTEP).expand(2, -1)
    if case.image_tokens:
        image = torch.randn(1, case.image_tokens, config.image_dim, generator=gen)
        out["image"] = image.to(device, torch.bfloat16).expand(2, -1, -1)  # the same image for both rows
    return out


def guided(cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
    return uncond.float() + GUIDANCE * (cond.float() - uncond.float())


def mmgen_step(model: WanDiT, x: dict, attention: AttentionImpl) -> torch.Tensor:
    """One batch-2 call (cond and uncond stacked), as pipelines/denoise.py makes it."""
    extra = {"image_embeds": x["image"]} if "image" in x else {}
    with torch.no_grad():
        out = model(x["latents"], x["timestep"], x["text"], attention=attention, **extra)
    return guided(*out.chunk(2))


def diffusers_step(model: torch.nn.Module, x: dict) -> torch.Tensor:
    """Two batch-1 calls, cond then uncond, as WanPipeline / WanImageToVideoPipeline make them."""
    outs = []
    with torch.no_grad():
        for row in range(2):
            extra = {"encoder_hidden_states_image": x["image"][row : row + 1]} if "image" in x else {}
            rows = slice(row, row + 1)
            outs.append(
                model(x["latents"][rows], x["timestep"][rows], x["text"][rows], return_dict=False, **extra)[0]
            )
    return guided(*outs)


# ----------------------------------------------------------------------------------------------
# rows


@dataclass
class Row:
    case: str
    label: str
    ms: float | None = None
    peak_gib: float | None = None  # max allocated during the row, everything included
    max_abs: float | None = None
    rel_err: float | None = None
    note: str = ""


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def measure(
    row: Row,
    step: Callable[[dict], torch.Tensor],
    x: dict,
    warm: dict | None,
    iters: int,
    device: torch.device,
    expected: torch.Tensor | None,
) -> torch.Tensor | None:
    """Warm up on `warm` (skipped when None), time `iters` calls on `x` into row; errors are recorded."""
    try:
        if warm is not None:
            step(warm)
        reset_peak(device)
        # no untimed full-size call here (timed() makes one): at 720p each call costs 20-27 s
        out, times = _timed_calls(lambda: step(x), device, iters, None)
    except Exception as err:  # one failing row (an OOM) must not end the run
        row.note = one_line(err)
        print(f"  {row.case} {row.label}: FAILED {row.note}", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None
    row.ms = statistics.median(times)
    row.peak_gib = peak_gib(device)
    if expected is not None:
        row.max_abs, row.rel_err = max_abs(out, expected), relative_error(out, expected)
    print(
        f"  {row.case} {row.label}: {row.ms:.0f} ms, peak {row.peak_gib or float('nan'):.1f} GiB", flush=True
    )
    return out


def row_kernel_calls(model: WanDiT, x: dict, attention: AttentionImpl) -> str:
    """Which mmgen custom ops (the Triton row kernels) one call launches, and how many time-embedding rows."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if name.startswith("mmgen."):
                self.ops[name.split(".")[1]] += 1
            return func(*args, **(kwargs or {}))

    rows: list[int] = []
    hook = model.condition_embedder.time_proj.register_forward_hook(
        lambda m, a, o: rows.append(a[0].shape[0])
    )
    try:
        with Count() as count:
            mmgen_step(model, x, attention)
    finally:
        hook.remove()
    ops = ", ".join(f"{name} {n}" for name, n in sorted(count.ops.items())) or "none (torch path)"
    return f"{len(model.blocks)} blocks; row kernels per call: {ops}; time embedding rows {rows}"


def attention_for(device: torch.device) -> AttentionImpl:
    """FA3 through fa3-fwd when installed (the Wan2.1 path's kernel), else what 'auto' picks."""
    name = "flash:fa3" if device.type == "cuda" and load_provider("fa3") is not None else "auto"
    return select_attention(name, device=device, dtype=torch.bfloat16, head_dim=128)


def case_floor(case: Case, device: torch.device, matmul: float) -> dict:
    """The floor of one CFG step (batch 2) from rates measured here at this case's attention shape."""
    work = dit_flops(case.config, 2, case.tokens, case.config.text_len)
    shape = (1, case.tokens, case.config.num_attention_heads, case.config.attention_head_dim)
    peaks = attention_peaks(device, shape) if device.type == "cuda" else {"nominal": NOMINAL_ATTENTION_TFLOPS}
    return floor_ms(work.attention, work.linear, matmul, peaks)


def run_case(case: Case, device: torch.device, args: argparse.Namespace, matmul: float) -> list[Row]:
    rows: list[Row] = []
    try:
        floor = case_floor(case, device, matmul)
        print(
            f"{case.name}: {case.video}, latents {list(case.latents)} = {case.tokens} tokens; floor "
            f"{floor['ms']:.0f} ms (attention {floor['attention_ms']:.0f} ms at {floor['attention_tflops']:.0f} "
            f"TF/s {floor['attention_kernel']}, linear {floor['linear_ms']:.0f} ms at {matmul:.0f} TF/s)",
            flush=True,
        )
        _run_case(case, device, args, rows, floor)
    except KeyboardInterrupt:
        print(f"INTERRUPTED in {case.name}: the rows below were measured before the time limit", flush=True)
        rows.append(Row(case.name, "(interrupted)"))
        args.interrupted = True
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _run_case(
    case: Case, device: torch.device, args: argparse.Namespace, rows: list[Row], floor: dict
) -> None:
    iters = args.iters or case.iters
    warmup = args.warmup or case.warmup
    x = make_inputs(case, device)
    short = make_inputs(case, device, frames=max(1, case.latents[2] // 4)) if warmup == "short" else x
    attention = attention_for(device)
    tick = time.perf_counter()
    pairs = [build_models(case.config, device, seed=seed) for seed in range(case.experts)]
    print(f"  built {case.experts} model(s) in {time.perf_counter() - tick:.1f} s", flush=True)
    if case.per_token:
        small = make_inputs(case, device, frames=2)  # two frames: the conditioning frame at 0, one at t
        print(f"  {row_kernel_calls(pairs[0][1], small, attention)}", flush=True)
        del small
    for index, (reference, model) in enumerate(pairs):
        which = "" if case.experts == 1 else f" expert {index}"
        # The warm-up call (full size, or the first quarter of the frames): a second expert has the
        # same shapes, so every kernel is already loaded and compiled for it.
        warm = short if index == 0 else None
        rows.append(Row(case.name, f"diffusers default, 2x batch 1{which}"))
        expected = measure(
            rows[-1], lambda v, r=reference: diffusers_step(r, v), x, warm, iters, device, None
        )
        rows.append(Row(case.name, f"mmgen {attention.name}:{attention.provider} eager{which}"))
        measure(rows[-1], lambda v, m=model: mmgen_step(m, v, attention), x, warm, iters, device, expected)
        if args.torch_rows:
            model.set_fused_kernels(False)
            rows.append(
                Row(case.name, f"mmgen {attention.name}:{attention.provider} eager, torch rows{which}")
            )
            measure(
                rows[-1], lambda v, m=model: mmgen_step(m, v, attention), x, warm, iters, device, expected
            )
            model.set_fused_kernels(True)
        if args.compile:
            model.compile_blocks(fuse=False)  # fusing would copy q/k/v while diffusers holds the originals
            rows.append(Row(case.name, f"mmgen {attention.name}:{attention.provider} compiled{which}"))
            # warmed at full size: a compiled block recompiles for a new token count
            measure(rows[-1], lambda v, m=model: mmgen_step(m, v, attention), x, x, iters, device, expected)
        del expected
    for row in rows:
        if row.ms:
            row.note = f"{row.ms / floor['ms']:.2f}x floor"
    if case.experts == 2 and not args.no_parked:
        experts = [model for _, model in pairs]
        del pairs, reference, model  # diffusers' modules go; mmgen's hold the (shared) weights
        gc.collect()
        rows.extend(parked_rows(case, experts, x, attention, device))


def parked_rows(
    case: Case, experts: list[WanDiT], x: dict, attention: AttentionImpl, device: torch.device
) -> list[Row]:
    """A switch between two experts with the idle one parked in pinned host memory (OffloadPlacement
    'model' with the expert prefetch): load cost without a prefetch, the step during which the next
    expert copies in (both on the GPU), the switch wait, and the step with one expert on the GPU."""
    from torch import nn

    from mmgen.placement.offload import OffloadPlacement
    from pipelines.denoise import StepPlan

    rows: list[Row] = []
    t = torch.tensor(TIMESTEP)
    first, second = StepPlan(0, t, 0, GUIDANCE), StepPlan(1, t, 1, GUIDANCE)
    tick = time.perf_counter()
    placement = OffloadPlacement(
        "model",
        experts=experts,
        text_encoder=nn.Linear(1, 1),  # not part of this measurement
        vae=nn.Linear(1, 1),
        device=device,
        prefetch_experts=True,
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rows.append(Row(case.name, "parked: both experts to pinned host memory"))
    rows[-1].note = f"{time.perf_counter() - tick:.1f} s (once per pipeline)"
    try:
        reset_peak(device)
        tick = time.perf_counter()
        placement.before_step(first, None)  # expert 0 in alone: what a switch costs without a prefetch
        _synchronize(device)
        load = Row(case.name, "parked: load expert 0, no prefetch", (time.perf_counter() - tick) * 1e3)
        load.peak_gib = peak_gib(device)
        rows.append(load)
        reset_peak(device)
        placement.before_step(first, second)  # expert 1 starts copying in on the side stream
        rows.append(Row(case.name, "parked+prefetch: expert 0 step, expert 1 copying in"))
        measure(rows[-1], lambda v: mmgen_step(experts[0], v, attention), x, None, 1, device, None)
        tick = time.perf_counter()
        placement.before_step(second, None)  # parks expert 0, waits for the prefetch
        _synchronize(device)
        rows.append(Row(case.name, "parked+prefetch: switch wait", (time.perf_counter() - tick) * 1e3))
        rows.append(Row(case.name, "parked: expert 1 step, expert 0 on host"))
        measure(rows[-1], lambda v: mmgen_step(experts[1], v, attention), x, None, 1, device, None)
        rows[-1].note = f"log {' '.join(f'{a}:{n}' for a, n in placement.log[-4:])}"
    finally:
        placement.release(to="cpu")  # unpin; the weights stay host tensors and go with the models
    return rows


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------
# estimate and report


def estimate_seconds(case: Case, args: argparse.Namespace) -> dict[str, float]:
    """Wall seconds this case should take on an H100, from FLOPs at the nominal rates (no GPU needed)."""
    work = dit_flops(case.config, 2, case.tokens, case.config.text_len)
    floor = work.attention / NOMINAL_ATTENTION_TFLOPS / 1e12 + work.linear / NOMINAL_GEMM_TFLOPS / 1e12
    # one diffusers row + one mmgen row (+ one on the torch row path, ~1.4x floor: RESULTS 13's TI2V row)
    step = floor * (DIFFUSERS_OVER_FLOOR + MMGEN_OVER_FLOOR + (1.4 if args.torch_rows else 0.0))
    iters = args.iters or case.iters
    warm = 1.0 if (args.warmup or case.warmup) == "full" else 0.12  # a quarter of the frames
    timed_s = step * (case.experts * iters + warm)
    params_gb = 2 * case.experts * _params(case.config) / 1e9
    parked = 0.0
    if case.experts == 2 and not args.no_parked:
        # pin + copy out (~8 GB/s with registration), load one expert (~20 GB/s), two mmgen steps
        parked = params_gb / 8 + params_gb / 2 / 20 + 2 * floor * MMGEN_OVER_FLOOR
    extra = 5.0 + 2.0 * case.experts  # peaks, build on the GPU, inputs
    return {"floor_s": floor, "steps_s": timed_s, "parked_s": parked, "total_s": timed_s + parked + extra}


def _params(config: WanConfig) -> int:
    d = config.dim
    return config.num_layers * (6 * d * d + 2 * d * config.ffn_dim)


def print_table(device: torch.device, rows: list[Row]) -> None:
    print("\n" + environment_header(device))
    print(
        f"{'case':<8} {'row':<52} {'ms':>9} {'x diffusers':>11} {'peak GiB':>8} {'max abs':>9} {'rel err':>9}  note"
    )
    reference: dict[tuple[str, str], float] = {}
    for row in rows:
        which = row.label.rpartition("expert")[2] if "expert" in row.label else ""
        if row.label.startswith("diffusers") and row.ms:
            reference[(row.case, which)] = row.ms
        base = reference.get((row.case, which)) if row.label.startswith("mmgen") else None
        cells = [
            f"{row.ms:9.0f}" if row.ms is not None else f"{'-':>9}",
            f"{base / row.ms:11.2f}" if base and row.ms else f"{'-':>11}",
            f"{row.peak_gib:8.1f}" if row.peak_gib is not None else f"{'-':>8}",
            f"{row.max_abs:9.2e}" if row.max_abs is not None else f"{'-':>9}",
            f"{row.rel_err:9.2e}" if row.rel_err is not None else f"{'-':>9}",
        ]
        print(f"{row.case:<8} {row.label:<52} {' '.join(cells)}  {row.note}")
    print(
        "(ms: one guided step, median; x diffusers: diffusers default ms / this row's ms, same expert; "
        "peak: max GPU memory allocated during the row, weights included; errors: guided prediction vs diffusers)"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), action="append", help="repeatable; default: all")
    parser.add_argument("--iters", type=int, help="timed steps per row (default: the case's, see CASES)")
    parser.add_argument("--warmup", choices=("full", "short"), help="default: the case's")
    parser.add_argument("--compile", action="store_true", help="add mmgen rows with compile_blocks()")
    parser.add_argument(
        "--torch-rows", action="store_true", help="add mmgen rows with the row passes on the torch path"
    )
    parser.add_argument("--no-parked", action="store_true", help="skip a14b's parked-expert rows")
    parser.add_argument("--estimate", action="store_true", help="print the H100 time estimates and exit")
    parser.add_argument("--tiny", action="store_true", help="tiny configs on the CPU (dry run of every path)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    args.interrupted = False
    names = args.case or list(CASES)
    print("estimated H100 seconds (nominal rates, GPU.md):")
    for name in names:
        estimate = estimate_seconds(CASES[name], args)
        print(f"  {name:<8} " + ", ".join(f"{k} {v:.0f}" for k, v in estimate.items()))
    if args.estimate:
        return 0
    device = bench_device(args.tiny)
    matmul = matmul_peak(device, 8192) if device.type == "cuda" else NOMINAL_GEMM_TFLOPS
    rows: list[Row] = []
    for name in names:
        if args.interrupted:
            break
        case = tiny_case(CASES[name]) if args.tiny else CASES[name]
        rows += run_case(case, device, args, matmul)
    print_table(device, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
