"""Issue 18's GPU table: a Wan DiT step and the whole pipeline under GPU memory caps, mmgen's offload
against mmgen resident and diffusers' group offloading, in one run.

Run from the repository root on one CUDA GPU, with diffusers importable (.gpu bundles, GPU.md):

    python3 benchmarks/offload_step.py --model 14b --caps 24,12,8     # Wan2.1-14B, 720x1280x81
    python3 benchmarks/offload_step.py --model 1.3b --caps 8,4        # Wan2.1-1.3B, 480x832x81
    python3 benchmarks/offload_step.py --tiny                         # CPU smoke run of the harness

Caps are torch.cuda.set_per_process_memory_fraction(cap / total): the caching allocator refuses
to grow past them (what the process allocates, not the CUDA context). Random bf16 weights.

Rows, in this order (so that only one copy of the DiT is ever on the GPU):
1. diffusers WanTransformer3DModel resident (no cap): one batch-1 forward (WanPipeline makes two
   per CFG step); then, per cap, apply_group_offloading block_level (1 block / group) and
   leaf_level, both with use_stream, on the same model (its hooks removed between rows);
2. mmgen WanDiT resident (no cap): one CFG step as the pipeline runs it (batch 2) and as two
   batch-1 calls; then per cap the plan mmgen.placement picks for that budget (layer offload:
   blocks streamed from pinned host memory one block ahead; sequential CFG / FFN chunks where the
   estimate needs them), or `--offload layer` forced;
3. the whole mmgen pipeline (UMT5-XXL, the DiT, the Wan2.1 VAE, UniPC, --steps steps) per cap
   with --gpu-memory-gb = cap: seconds and measured peak per stage, the plan it chose.
Plus the pinned host-to-device bandwidth measured here and the byte floor of streaming the DiT's
blocks once per forward (a CFG step in batch 2 streams them once, sequential CFG twice). The table
is printed last; each row's ratio is against its own resident row (diffusers per batch-1 forward,
as its group-offloading table in issue 18; mmgen per CFG step).

Wan2.1-14B at 720p takes ~15 minutes for everything at --iters 2; split a run with --skip-diffusers,
--skip-pipeline and fewer --caps to stay within a per-command limit.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_utils import timed, versions  # noqa: E402
from dit_step import make_inputs  # noqa: E402
from wan_models import MODELS, RANDOM, TINY  # noqa: E402

from mmgen.attention import select_attention  # noqa: E402
from mmgen.loading.wan_transformer import wan_dit_from_tensors  # noqa: E402
from mmgen.placement.offload import OffloadPlacement  # noqa: E402
from mmgen.placement.policy import GIB, MemoryPlan, Workload, plan_memory  # noqa: E402
from mmgen.placement.tensors import module_bytes  # noqa: E402


@dataclass
class Row:
    who: str
    mode: str
    cap: str
    seconds: float | None = None  # per forward (diffusers) or per CFG step (mmgen)
    unit: str = "step"
    peak_gib: float | None = None
    note: str = ""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="14b")
    parser.add_argument("--caps", default="24,12,8", help="GiB caps, comma-separated")
    parser.add_argument("--iters", type=int, default=2, help="timed calls per row (after one warm-up)")
    parser.add_argument("--steps", type=int, default=2, help="denoising steps of the pipeline rows")
    parser.add_argument("--offload", choices=("plan", "layer", "model"), default="plan")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--skip-diffusers", action="store_true")
    parser.add_argument("--skip-pipeline", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run with a tiny config")
    return parser.parse_args()


def capped(device: torch.device, cap_gib: float | None) -> None:
    """Cap (or uncap) what the caching allocator may hold on `device`; frees cached blocks first."""
    gc.collect()
    if device.type != "cuda":
        return
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(
        1.0 if cap_gib is None else min(1.0, cap_gib * GIB / total),
        device.index if device.index is not None else torch.cuda.current_device(),
    )


def measure(row: Row, fn: Callable[[], object], device: torch.device, iters: int) -> None:
    """Median seconds of fn over `iters` timed calls after one warm-up, and the peak allocated GiB."""
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _, _, times = timed(fn, device, warmup=1, iters=iters)
        row.seconds = statistics.median(times) / 1e3
        if device.type == "cuda":
            row.peak_gib = torch.cuda.max_memory_allocated(device) / GIB
    except torch.OutOfMemoryError:
        row.note = "OOM"
    except Exception as err:  # a row that cannot run says why; the others go on
        row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def h2d_bandwidth(device: torch.device) -> float:
    """Pinned host -> device GB/s over 1 GiB, median of 5 copies."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(GIB, dtype=torch.uint8, device=device)
    _, _, times = timed(lambda: dst.copy_(src, non_blocking=True), device, warmup=2, iters=5)
    return GIB / (statistics.median(times) * 1e-3) / 1e9


def diffusers_rows(config, inputs, device, caps, iters) -> list[Row]:
    from diffusers import WanTransformer3DModel
    from diffusers.hooks import apply_group_offloading

    torch.manual_seed(0)
    with torch.device(device), default_dtype(torch.bfloat16):  # a 14B model built in fp32 would need 57 GB
        reference = WanTransformer3DModel(**config.to_diffusers_config())
    for name, param in reference.named_parameters():
        if any(part in WanTransformer3DModel._keep_in_fp32_modules for part in name.split(".")):
            param.data = param.data.float()
    reference.eval().requires_grad_(False)
    one = (inputs.latents[:1], inputs.timestep[:1], inputs.text[:1])

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return reference(*one, return_dict=False)[0]

    rows = [Row("diffusers", "resident", "none", unit="forward")]
    measure(rows[-1], forward, device, iters)
    reference.to("cpu")
    for cap in caps:
        for kind in ("block_level", "leaf_level"):
            capped(device, cap)
            row = Row("diffusers", f"group {kind} + stream", f"{cap:g}", unit="forward")
            extra = {"num_blocks_per_group": 1} if kind == "block_level" else {}
            try:
                apply_group_offloading(
                    reference, onload_device=device, offload_type=kind, use_stream=True, **extra
                )
                measure(row, forward, device, iters)
                _remove_group_offloading(reference)
            except Exception as err:  # report and go on to mmgen's rows
                row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
            rows.append(row)
    capped(device, None)
    return rows  # the model (now on the host) goes with this frame


def _remove_group_offloading(module: torch.nn.Module) -> None:
    from diffusers.hooks import HookRegistry

    for sub in module.modules():
        registry = getattr(sub, "_diffusers_hook", None)
        if isinstance(registry, HookRegistry):
            for name in list(registry.hooks):
                registry.remove_hook(name, recurse=False)
    module.to("cpu")


def mmgen_rows(model, inputs, device, caps, args, plans) -> tuple[list[Row], int]:
    attention = select_attention(
        args.attention, device=device, dtype=torch.bfloat16, head_dim=model.config.attention_head_dim
    )

    def step(batch: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with torch.no_grad():
                if batch:
                    return model(inputs.latents, inputs.timestep, inputs.text, attention=attention)
                halves = [
                    model(
                        inputs.latents[i : i + 1],
                        inputs.timestep[i : i + 1],
                        inputs.text[i : i + 1],
                        attention=attention,
                    )
                    for i in (0, 1)
                ]
                return torch.cat(halves)

        return run

    model.to(device)
    rows = [Row("mmgen", "resident, CFG batch 2", "none"), Row("mmgen", "resident, CFG 2x batch 1", "none")]
    measure(rows[0], step(True), device, args.iters)
    measure(rows[1], step(False), device, args.iters)
    side = {"text_encoder": torch.nn.Linear(1, 1), "vae": torch.nn.Linear(1, 1)}
    placement = OffloadPlacement("layer", experts=[model], device=device, **side)
    streamed = placement.stream.block_bytes * len(model.blocks)
    for cap in caps:
        plan = plans[cap]
        capped(device, cap)
        for module in model.modules():
            if hasattr(module, "token_chunk"):
                module.token_chunk = plan.ffn_chunk
        row = Row("mmgen", f"layer, cfg {plan.cfg}, ffn_chunk {plan.ffn_chunk or 'off'}", f"{cap:g}")
        measure(row, step(plan.cfg == "batch"), device, args.iters)
        rows.append(row)
    capped(device, None)
    placement.release()
    for module in model.modules():
        if hasattr(module, "token_chunk"):
            module.token_chunk = None
    return rows, streamed


def pipeline_rows(model, config, video, device, caps, args) -> list[Row]:
    """The whole pipeline per cap with gpu_memory_gb = cap; seconds and peak GiB per stage."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config as HFUMT5Config
    from transformers import UMT5EncoderModel

    from mmgen.default_model import VAE, WORDS
    from mmgen.loading.diffusers_dir import GenerationDefaults
    from mmgen.loading.safetensors_dir import load_into_module
    from mmgen.loading.tokenizer import TextTokenizer, build_word_tokenizer
    from mmgen.models.umt5 import UMT5Config, UMT5Encoder
    from pipelines.wan_t2v import WanT2VPipeline

    if args.tiny:
        text_config = UMT5Config(
            vocab_size=512, d_model=config.text_dim, d_kv=8, d_ff=64, num_layers=2, num_heads=4
        )
        vae_config = {**VAE, "z_dim": 16, "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16}
    else:
        text_config = UMT5Config(
            vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64
        )
        vae_config = {}
    workdir = Path(tempfile.mkdtemp(prefix="mmgen-offload-"))
    build_word_tokenizer(list(WORDS), workdir / "tokenizer", model_max_length=config.text_len)
    torch.manual_seed(3)
    with torch.device(device), default_dtype(torch.bfloat16):  # random init on the GPU is fast
        hf = UMT5EncoderModel(HFUMT5Config(**text_config.to_hf_config())).eval()
    with torch.device("meta"):
        encoder = UMT5Encoder(text_config)
    tensors = {k: (v, RANDOM) for k, v in hf.state_dict().items() if k != "encoder.embed_tokens.weight"}
    load_into_module(encoder, tensors, source=RANDOM, dtype=torch.bfloat16, device="cpu")
    del hf, tensors
    with default_dtype(torch.bfloat16):
        vae = AutoencoderKLWan(**vae_config).eval()
    model.to("cpu")
    capped(device, None)
    height, width, frames = video
    pipe = WanT2VPipeline(
        model,
        encoder.eval(),
        TextTokenizer.from_dir(workdir / "tokenizer"),
        vae,
        UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
        defaults=GenerationDefaults(
            height=height, width=width, num_frames=frames, num_inference_steps=args.steps
        ),
        device=device,
    )
    rows = []
    for cap in caps:
        capped(device, cap)
        row = Row("mmgen pipeline", "planned", f"{cap:g}", unit="step")
        try:
            result = pipe(
                "a red fox in the snow",
                seed=1,
                gpu_memory_gb=cap if device.type == "cuda" else 1e9,
                attention_backend=args.attention if device.type == "cuda" else "sdpa",
                progress=False,
            )
            plan = result.args["memory_plan"]
            row.mode = f"{plan['offload']}, cfg {plan['cfg']}, decode {plan['decode']}" + (
                " (lossy)" if plan["lossy"] else ""
            )
            row.seconds = result.timings["denoise"] / args.steps
            row.peak_gib = result.memory.get("denoise")
            stages = ", ".join(f"{k} {v:.1f}s" for k, v in result.timings.items() if k != "total")
            peaks = ", ".join(f"{k} {v:.2f}" for k, v in result.memory.items())
            row.note = f"{stages}; peak GiB {peaks or 'n/a'}"
        except torch.OutOfMemoryError:
            row.note = "OOM"
        except Exception as err:
            row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:140]}"
        rows.append(row)
    capped(device, None)
    return rows


def print_table(rows: list[Row], h2d: float, streamed: int, device_name: str) -> None:
    floor = streamed / (h2d * 1e9) if h2d == h2d else float("nan")
    print(f"\ndevice {device_name} | " + " | ".join(f"{k} {v}" for k, v in versions().items()))
    print(
        f"pinned host->device {h2d:.1f} GB/s; DiT blocks {streamed / GIB:.2f} GiB -> byte floor {floor:.3f} s per forward"
    )
    # Each row against its own resident row: diffusers forwards against diffusers' resident forward,
    # mmgen steps and pipeline steps against mmgen's resident CFG step (batch 2).
    resident = {
        "diffusers": next((r.seconds for r in rows if r.who == "diffusers" and r.cap == "none"), None),
        "mmgen": next((r.seconds for r in rows if r.mode == "resident, CFG batch 2"), None),
    }
    header = ("who", "mode", "cap GiB", "s", "per", "x resident", "peak GiB", "note")
    table = [header]
    for r in rows:
        base = resident["diffusers" if r.who == "diffusers" else "mmgen"]
        ratio = "-" if r.seconds is None or not base else f"{r.seconds / base:.3f}"
        table.append((
            r.who, r.mode, r.cap, "-" if r.seconds is None else f"{r.seconds:.3f}", r.unit, ratio,
            "-" if r.peak_gib is None else f"{r.peak_gib:.2f}", r.note,
        ))  # fmt: skip
    widths = [max(len(str(t[i])) for t in table) for i in range(len(header))]
    for t in table:
        print("  ".join(str(c).ljust(w) for c, w in zip(t, widths, strict=True)).rstrip())


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.tiny:
        sys.exit("no CUDA device: run on a GPU, or pass --tiny for a CPU smoke run")
    config, video = (TINY, (64, 96, 9)) if args.tiny else MODELS[args.model]
    caps = [float(c) for c in args.caps.split(",")] if not args.tiny else [1.0]
    # Measured first: host-registered weights from the placement rows must not share its pinned buffer.
    h2d = h2d_bandwidth(device)
    inputs = make_inputs(config, video, device)
    rows: list[Row] = []
    if not args.skip_diffusers and device.type == "cuda":
        rows += diffusers_rows(config, inputs, device, caps, args.iters)
    torch.manual_seed(0)
    from mmgen.models.wan import WanDiT

    with torch.device(device), default_dtype(torch.bfloat16):
        source = WanDiT(config)
    tensors = {k: (v, RANDOM) for k, v in source.state_dict().items()}
    model = wan_dit_from_tensors(config, tensors, source=RANDOM, dtype=torch.bfloat16, device="cpu")
    del source, tensors
    capped(device, None)
    sizes_block = module_bytes(model.blocks[0])
    tokens = inputs.tokens
    plans = {}
    for cap in caps:
        if args.offload == "plan" and device.type == "cuda":
            plans[cap] = _dit_plan(model, tokens, video, cap)
        else:
            plans[cap] = MemoryPlan(offload="layer")
    mm_rows, streamed = mmgen_rows(model, inputs, device, caps, args, plans)
    rows += mm_rows
    if not args.skip_pipeline:
        try:
            rows += pipeline_rows(model, config, video, device, caps, args)
        except Exception as err:  # still print the step rows measured above
            print(f"pipeline rows failed: {' '.join(str(err).split())[:300]}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print_table(rows, h2d, streamed or sizes_block * len(model.blocks), name)


def _dit_plan(model, tokens: int, video: tuple[int, int, int], cap: float) -> MemoryPlan:
    """The planner's layer-offload plan for the DiT step alone (text encoder and VAE not counted)."""
    from mmgen.placement.policy import ModelSizes

    config = model.config
    sizes = ModelSizes(
        expert_bytes=(module_bytes(model),), block_bytes=module_bytes(model.blocks[0]), blocks=len(model.blocks),
        text_encoder_bytes=0, vae_bytes=0, dim=config.dim, ffn_dim=config.ffn_dim,
        head_dim=config.attention_head_dim, dtype_bytes=2, text_dim=1, text_ffn_dim=1, vae_dtype_bytes=2,
    )  # fmt: skip
    height, width, frames = video
    work = Workload(tokens=tokens, guided=True, text_len=config.text_len, frames=1, height=16, width=16)
    try:
        return plan_memory(sizes, work, cap, offload="layer")
    except Exception:
        return MemoryPlan(offload="layer", cfg="sequential", ffn_chunk=max(1, tokens // 8))


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"({time.perf_counter() - started:.0f} s)")
