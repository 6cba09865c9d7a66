"""Qwen-Image-2.1 end to end: mmgen's family pipeline against diffusers' QwenImage21Pipeline, one GPU.

Run from the repository root on a CUDA machine with diffusers 0.42.1 and transformers (fa3-fwd optional):

    python3 benchmarks/qwen_image21_e2e.py                 # 1024x1024, 40 steps: T2I and an edit
    python3 benchmarks/qwen_image21_e2e.py --cases t2i     # one case
    python3 benchmarks/qwen_image21_e2e.py --gpus 2        # and mmgen with Ulysses over 2 GPUs
    python3 benchmarks/qwen_image21_e2e.py --tiny          # CPU smoke run of the harness (2 steps)
    python3 benchmarks/qwen_image21_e2e.py --gpus 2 --profile 25 --cases t2i   # the Ulysses ranks' kernels only

Random bf16 weights at the release configs are built once on the GPU and shared by both pipelines (one
copy): the 7.12 B transformer (diffusers' QwenImage21Transformer2DModel defaults; mmgen's
QwenImage21Transformer holds the same tensors), the text encoder at Qwen3-VL-8B-Instruct's config (the
release ships that model unchanged as text_encoder/; 4096 wide = the transformer's context_in_dim), the
VAE at AutoencoderKLQwenImage21's defaults (bf16, as `from_pretrained(dtype=torch.bfloat16)` loads it;
mmgen's own loader keeps it in float32 by default).
The tokenizer is the tests' tiny byte-level Qwen2 one with Qwen's chat and vision tokens (ids differ
from Qwen's; the prompt is 200 text tokens, the issue's anchor); the image processor is transformers'
at Qwen3-VL's pixel bounds, so a 1024x1024 condition image is 1024 merged vision tokens, as released.

Each pipeline runs at the defaults (40 steps, guidance 1.0, no negative prompt) with its prefix KV cache
on (diffusers' use_kv_cache=True, its default; mmgen's default), seed 0; one warm-up call of 3 steps
(the prefill and two cached steps: mmgen captures its cached call at the second, and a later request of
the same shapes replays that kept capture from its first cached step, as a server's does), then one
timed call. Cases: text-to-image, and an edit with one
condition image of the same side. Printed per pipeline: seconds per image split into encode (text
encoder + vision tower, and the condition image's VAE encode), denoise and decode, the denoise loop per
step (the first step is the prefill), peak GPU memory (total, and above the weights), and how far the
two images are apart (random weights through 40 bf16 steps: a number, not a check; the fp32 CPU parity
tests are the check). diffusers' split comes from forward hooks on its transformer (CUDA events at the
first call's start and the last call's end; no added synchronization); mmgen's from its own timings.

--gpus N adds mmgen with Ulysses over N GPUs: after the one-GPU rows this process frees its models,
then N spawned ranks (mmgen.parallel.launch, NCCL; gloo on the CPU with --tiny) each build the same
seeded weights on their GPU and run the same calls; rank 0's seconds, split and peak are the row, its
speedup is against diffusers on one GPU. SGLang publishes 2.91 s end to end at 1024x1024 on two H100s.

--profile K (with --gpus N) runs only the Ulysses ranks: after their timed calls each rank, one after
another, prints the K costliest kernels of a PROFILE_STEPS-step call (torch.profiler), the call's wall
seconds against its kernels' device time (a gap is time the GPU sat idle: host launches, or waiting for
the other rank), and the collectives' share.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the checkout, and the tests' tiny tokenizer and configs

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_utils import (  # noqa: E402
    bench_device,
    environment_header,
    print_kernels,
    print_table,
    profiled_kernels,
    synchronize,
    write_json,
)
from qwen_image21_pipeline_cases import (  # noqa: E402
    SCHEDULER,
    TINY21_TRANSFORMER,
    TINY21_VAE,
    tiny_processor,
    tiny_text_encoder,
    vision_token_ids,
)
from qwen_image21_step import build_models  # noqa: E402

from mmgen.loading.qwen_image21_dir import QwenImage21Components  # noqa: E402
from mmgen.parallel.launch import run_parallel  # noqa: E402
from mmgen.parallel.layout import ParallelConfig, ParallelLayout  # noqa: E402
from mmgen.render.metrics import psnr_uint8  # noqa: E402
from pipelines.qwen_image21 import SIZE_MULTIPLE, prompt_texts, system_prefix_tokens  # noqa: E402
from pipelines.qwen_image21_family import QwenImage21FamilyPipeline  # noqa: E402

PROMPT = (
    "A quiet harbour town at dawn, painted boats resting on still water, gulls over the pier, warm light on "
    "white houses climbing the hill, a lighthouse far away, mist over the sea, soft colours."
)
WARMUP_STEPS = 3  # the prefill and two cached steps (mmgen: an eager one, then the kept capture)
CASES = ("t2i", "edit")
PROFILE_STEPS = 4
# Qwen3-VL-8B-Instruct (the release's text_encoder/): the language model and the vision tower.
TEXT_8B = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": [24, 20, 20],
        "mrope_interleaved": True,
    },
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}
VISION_8B = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "out_hidden_size": 4096,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}
# Qwen3-VL's preprocessor_config.json size: shortest_edge / longest_edge, in pixels.
QWEN3_VL_PIXELS = (65536, 16777216)


def text_encoder_8b(tokenizer, device: torch.device, dtype: torch.dtype):
    """Qwen3VLForConditionalGeneration at the 8B config with random weights, built on the device; its
    vision token ids are the tokenizer's."""
    import transformers

    config = transformers.Qwen3VLConfig(
        text_config=TEXT_8B, vision_config=VISION_8B, tie_word_embeddings=False, **vision_token_ids(tokenizer)
    )
    with torch.device(device):
        model = transformers.Qwen3VLForConditionalGeneration._from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def build_parts(tiny: bool, device: torch.device, dtype: torch.dtype, directory: Path) -> dict:
    """diffusers' pipeline parts (its transformer as `reference`), mmgen's transformer on the same tensors."""
    import diffusers

    torch.manual_seed(0)  # the text encoder's and the VAE's random init: the same weights in every process
    pixels = {} if tiny else dict(zip(("min_pixels", "max_pixels"), QWEN3_VL_PIXELS, strict=True))
    processor = tiny_processor(directory, **pixels)
    reference, ours = build_models(TINY21_TRANSFORMER if tiny else {}, device, dtype)
    if tiny:
        encoder = tiny_text_encoder(processor.tokenizer).to(device, dtype)
        vae = diffusers.AutoencoderKLQwenImage21(**TINY21_VAE)
    else:
        encoder = text_encoder_8b(processor.tokenizer, device, dtype)
        with torch.device(device):
            vae = diffusers.AutoencoderKLQwenImage21()
    return {
        "reference": reference,
        "ours": ours,
        "text_encoder": encoder,
        "processor": processor,
        "vae": vae.to(device, dtype).eval().requires_grad_(False),
        "scheduler": diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULER),
    }


class ModelSpan:
    """When a module's first call in a pipeline call starts and its last one ends, through forward hooks:
    CUDA events on a GPU (recorded in stream order, nothing waits), perf_counter on the CPU."""

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.device = device
        self.marks: dict[str, object] = {}
        module.register_forward_pre_hook(self._before)
        module.register_forward_hook(self._after)

    # A hook that returns something replaces the module's inputs or output: these return None.
    def _before(self, module: torch.nn.Module, inputs: tuple) -> None:
        if "first" not in self.marks:
            self.marks["first"] = self.mark()

    def _after(self, module: torch.nn.Module, inputs: tuple, output: object) -> None:
        self.marks["last"] = self.mark()

    def mark(self) -> object:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: object, end: object) -> float:
        if self.device.type != "cuda":
            return end - start
        return start.elapsed_time(end) / 1e3

    def split(self, call) -> tuple[object, dict[str, float]]:
        """(call's output, {encode, denoise, decode} seconds) of one call of `call`."""
        self.marks = {"start": self.mark()}
        out = call()
        self.marks["end"] = self.mark()
        synchronize(self.device)
        m = self.marks
        names = (("encode", "start", "first"), ("denoise", "first", "last"), ("decode", "last", "end"))
        return out, {name: self.seconds(m[a], m[b]) for name, a, b in names}


def text_tokens(processor) -> int:
    """The prompt's text tokens after the system prefix drop (what the transformer reads for T2I)."""
    ids = processor.tokenizer(prompt_texts([PROMPT], 0)[0]).input_ids
    return len(ids) - system_prefix_tokens(processor)


def condition_image(size: int) -> np.ndarray:
    """The edit's condition image: seeded noise, uint8 [size, size, 3]."""
    return (np.random.RandomState(0).rand(size, size, 3) * 255).astype(np.uint8)


def mmgen_pipeline(parts: dict, device: torch.device, size: int, **options) -> QwenImage21FamilyPipeline:
    """mmgen's pipeline over the parts, built from components as its tests build it."""
    names = ("scheduler", "vae", "text_encoder", "processor")
    components = QwenImage21Components(
        transformer=parts["ours"], sample_sigmas=None, source=None, **{k: parts[k] for k in names}
    )
    return QwenImage21FamilyPipeline(components, device=device, condition_resolution=size, **options)


class StepClock:
    """A progress reporter that stamps each denoise step as mmgen reports it: once it has finished on
    the device (pipelines.devices.StepFence), so the gaps are the steps' durations; the first runs from
    the loop's start (the prefill, and anything the loop does before it)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._stage = ""

    def stage(self, name: str, total: int) -> None:
        self._stage = name
        if name == "denoise":
            self.stamps = [time.perf_counter()]

    def advance(self, units: int = 1) -> None:
        if self._stage == "denoise":
            self.stamps += [time.perf_counter()] * units

    def close(self) -> None:
        pass

    def split(self) -> dict[str, float]:
        """The first step's ms (the prefill) and the later steps' median and slowest ms."""
        ms = [(b - a) * 1e3 for a, b in zip(self.stamps[:-1], self.stamps[1:], strict=True)]
        later = sorted(ms[1:]) or [float("nan")]
        return {"prefill_ms": ms[0], "step_p50_ms": later[len(later) // 2], "step_max_ms": later[-1]}


def mmgen_call(pipe, condition: np.ndarray | None, size: int, steps: int) -> tuple[np.ndarray, dict]:
    """mmgen's image (RGBA uint8 [H, W, 4]) and its {encode, denoise, decode} seconds and step times
    (StepClock); an edit of `condition` unless None."""
    image = {} if condition is None else {"image": condition}
    clock = StepClock()
    out = pipe(PROMPT, **image, height=size, width=size, num_inference_steps=steps, seed=0, progress=clock)
    t = out.timings
    split = {"encode": t["text_encode"] + t.get("image_encode", 0.0), "denoise": t["denoise"]}
    return out.frames[0], {**split, "decode": t["decode"], **clock.split()}


def diffusers_call(
    pipe, span: ModelSpan, condition: np.ndarray | None, size: int, steps: int
) -> tuple[np.ndarray, dict]:
    """diffusers' image (RGBA uint8 [H, W, 4], converted as mmgen converts) and its split (the span)."""
    image = {} if condition is None else {"image": condition}
    out, split = span.split(
        lambda: pipe(
            PROMPT,
            **image,
            height=size,
            width=size,
            num_inference_steps=steps,
            generator=torch.Generator().manual_seed(0),
            output_type="np",
            output_resolution=size,
            use_kv_cache=True,
        )
    )
    return (out.images[0] * 255).round().clip(0, 255).astype(np.uint8), split


def measure(call, device: torch.device, steps: int, weights: int, ready=lambda: None) -> dict:
    """call(steps) once after a warm-up call(WARMUP_STEPS): image, seconds, split, peak GiB (total and
    above `weights` bytes); `ready` runs just before the timed call (a barrier across ranks)."""
    call(WARMUP_STEPS)  # kernels, allocator, autotuning
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    ready()
    start = time.perf_counter()
    image, split = call(steps)
    synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    above = None if peak is None else peak - weights / 2**30
    return {"image": image, "s": seconds, **split, "peak_gib": peak, "above_weights_gib": above}


def one_gpu(args: argparse.Namespace, device: torch.device) -> dict:
    """diffusers' and mmgen's rows on one device: {case: {who: measurement}}, the text tokens, the weights."""
    import diffusers

    dtype = torch.float32 if args.tiny else torch.bfloat16
    with tempfile.TemporaryDirectory() as directory:
        parts = build_parts(args.tiny, device, dtype, Path(directory))
    names = ("scheduler", "vae", "text_encoder", "processor")
    theirs = diffusers.QwenImage21Pipeline(transformer=parts["reference"], **{k: parts[k] for k in names})
    theirs.set_progress_bar_config(disable=True)
    span = ModelSpan(parts["reference"], device)
    mine = mmgen_pipeline(parts, device, args.size)
    eager = mmgen_pipeline(parts, device, args.size, cuda_graphs=False)
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    measured = {}
    for case in args.cases:
        condition = condition_image(args.size) if case == "edit" else None
        calls = {
            "diffusers": lambda n, c=condition: diffusers_call(theirs, span, c, args.size, n),
            "mmgen": lambda n, c=condition: mmgen_call(mine, c, args.size, n),
            "mmgen eager": lambda n, c=condition: mmgen_call(eager, c, args.size, n),
        }
        measured[case] = {who: measure(call, device, args.steps, weights) for who, call in calls.items()}
    return {
        "rows": measured,
        "text_tokens": text_tokens(parts["processor"]),
        "weights": weights,
        "dtype": dtype,
    }


def ulysses_rank(
    layout: ParallelLayout, tiny: bool, size: int, steps: int, cases: tuple[str, ...], profile: int = 0
) -> dict:
    """One rank of mmgen's Ulysses rows (run_parallel): {case: {variant: measurement}} (cached steps as
    CUDA graphs, and eager); rank 0's is returned."""
    import torch.distributed as dist

    device = layout.device if layout.device is not None else torch.device("cpu")
    dtype = torch.float32 if tiny else torch.bfloat16
    with tempfile.TemporaryDirectory() as directory:
        parts = build_parts(tiny, device, dtype, Path(directory))
    del parts["reference"]  # diffusers' transformer: the same tensors as mmgen's, unused here
    pipes = {
        "": mmgen_pipeline(parts, device, size, layout=layout),
        " eager": mmgen_pipeline(parts, device, size, layout=layout, cuda_graphs=False),
    }
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    measured = {}
    for case in cases:
        condition = condition_image(size) if case == "edit" else None
        measured[case] = {}
        for variant, pipe in pipes.items():
            measured[case][variant] = measure(
                lambda n, c=condition, p=pipe: mmgen_call(p, c, size, n),
                device,
                steps,
                weights,
                ready=dist.barrier,
            )
            pipe.kept_graphs.clear()  # its graphs' memory pool is not held through the next variant's rows
        if profile:
            call = partial(mmgen_call, pipes[""], condition, size, PROFILE_STEPS)
            profile_ranks(call, case, device, profile)
    return measured


def profile_ranks(call, case: str, device: torch.device, top: int) -> None:
    """Each rank in turn (barriers between) prints its kernels of one call (see --profile)."""
    import torch.distributed as dist

    dist.barrier()
    events, wall = profiled_kernels(call, device)
    total = sum(e.device_time_total for e in events) / 1e6
    collectives = sum(e.device_time_total for e in events if "nccl" in e.key.lower()) / 1e6
    for rank in range(dist.get_world_size()):
        if rank == dist.get_rank():
            print(f"rank {rank} {case} {PROFILE_STEPS} steps: wall {wall:.3f} s, kernels {total:.3f} s "
                  f"(collectives {collectives:.3f} s), idle {wall - total:.3f} s", flush=True)  # fmt: skip
            print_kernels(events, top)
        dist.barrier()


def report(args: argparse.Namespace, device: torch.device, run: dict) -> None:
    """The table (speedups against diffusers on one GPU), the image differences, the JSON."""
    rows, results, diffs = [], {}, []
    for case, measured in run["rows"].items():
        base = measured["diffusers"]["s"]
        for who, r in measured.items():
            results[f"{case}/{who}"] = {k: v for k, v in r.items() if k != "image"}
            rows.append(
                [
                    f"{case} {who}",
                    f"{r['s']:.2f}",
                    f"{r['encode']:.2f}",
                    f"{r['denoise']:.2f}",
                    f"{r['denoise'] * 1e3 / args.steps:.1f}",
                    f"{r['decode']:.2f}",
                    *(f"{r[k]:.1f}" if k in r else "-" for k in ("prefill_ms", "step_p50_ms")),
                    f"{base / r['s']:.2f}x",
                    r["peak_gib"],
                    r["above_weights_gib"],
                ]
            )
            if who != "diffusers":
                a, b = (measured[k]["image"].astype(np.float64) for k in ("diffusers", who))
                diff = {"max_abs": float(np.abs(a - b).max()), "psnr_db": psnr_uint8(a, b)}
                results[f"{case}/{who}/image_difference"] = diff
                same = np.array_equal(measured["mmgen"]["image"], measured[who]["image"])
                results[f"{case}/{who}/same_bits_as_mmgen"] = same
                diffs.append(
                    f"{case} {who} vs diffusers: images max abs {diff['max_abs']:.0f} of 255, "
                    f"PSNR {diff['psnr_db']:.1f} dB; {'the same' if same else 'other'} bits as mmgen (1 GPU)"
                )
    print(environment_header(device))
    print(
        f"Qwen-Image-2.1 e2e: {args.size}x{args.size}, {args.steps} steps, guidance 1.0, KV cache on, "
        f"{run['dtype']}; text {run['text_tokens']} tokens; weights {run['weights'] / 2**30:.1f} GiB"
    )
    print_table(
        [
            ("case, pipeline", 27),
            ("s", 7),
            ("encode", 7),
            ("denoise", 8),
            ("ms/step", 8),
            ("decode", 7),
            ("prefill", 8),
            ("p50 ms", 7),
            ("speedup", 8),
            ("peak GiB", 9),
            ("above w", 8),
        ],
        rows,
    )
    for line in diffs:
        print(line)
    write_json(args.json, {"size": args.size, "steps": args.steps, "rows": results})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024, help="image side (the edit's condition image too)")
    parser.add_argument("--steps", type=int, default=None, help="default 40 (2 with --tiny)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated of {', '.join(CASES)}")
    parser.add_argument(
        "--tiny", action="store_true", help="CPU smoke run on the tests' tiny configs (64x64)"
    )
    parser.add_argument(
        "--gpus", type=int, default=1, help="N > 1: also mmgen with Ulysses over N GPUs (N processes)"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--profile", type=int, default=0, help="K: the Ulysses ranks' K costliest kernels only"
    )
    args = parser.parse_args()
    args.cases = tuple(args.cases.split(","))
    if unknown := sorted(set(args.cases) - set(CASES)):
        parser.error(f"--cases: unknown {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if args.size % SIZE_MULTIPLE:
        parser.error(f"--size {args.size}: sides are multiples of {SIZE_MULTIPLE} (diffusers would round it)")
    if args.steps is None:
        args.steps = 2 if args.tiny else 40
    if args.tiny:
        args.size = 64
    if args.gpus < 1:
        parser.error(f"--gpus {args.gpus}: at least 1")
    if args.profile and args.gpus < 2:
        parser.error("--profile profiles the Ulysses ranks: give --gpus N (N >= 2)")
    device = bench_device(args.tiny)
    run = None if args.profile else one_gpu(args, device)
    if args.gpus > 1:
        gc.collect()  # diffusers' pipeline holds reference cycles: free its GPU tensors before the ranks
        if device.type == "cuda":
            torch.cuda.empty_cache()
        ranks = run_parallel(
            ulysses_rank,
            ParallelConfig(sp=args.gpus),
            args.tiny,
            args.size,
            args.steps,
            args.cases,
            args.profile,
            device_type=device.type,
            start_method="spawn",  # CUDA needs it; forked CPU ranks hang after this process's torch work
        )
        if run is None:
            return
        for case, variants in ranks.items():
            for variant, measured in variants.items():
                run["rows"][case][f"mmgen ulysses{args.gpus}{variant}"] = measured
    report(args, device, run)


if __name__ == "__main__":
    main()
