"""Issue 18's GPU table: a Wan DiT step and the whole pipeline under GPU memory caps, mmgen's offload
against mmgen resident and diffusers' group offloading, in one run.

Run from the repository root on one CUDA GPU, with diffusers importable (.gpu bundles, GPU.md):

    python3 benchmarks/offload_step.py --model 14b --caps 24,12,8 --iters 1 --cap-warmup 0 \
        --skip-pipeline --diffusers-caps 12,8 --no-diffusers-resident  # Wan2.1-14B 720x1280x81, ~290 s
    python3 benchmarks/offload_step.py --model 14b --caps 24 --iters 1 --cap-warmup 0 --skip-pipeline \
        --skip-diffusers --no-chunk-rows --no-batch1-row  # re-check: the first forward after placement
    python3 benchmarks/offload_step.py --model 1.3b --caps 4          # Wan2.1-1.3B 480x832x81
    python3 benchmarks/offload_step.py --tiny                         # CPU smoke run of the harness

Caps are torch.cuda.set_per_process_memory_fraction(cap / total): the caching allocator refuses
to grow past them (what the process allocates, not the CUDA context). Random bf16 weights, made on
the GPU (never a float32 host init of 14B parameters); the offloaded copy goes to pinned host memory.

Rows, in this order (only one copy of a DiT on the GPU at a time):
1. mmgen WanDiT resident (no cap): one CFG step as the pipeline runs it (batch 2) and as two
   batch-1 calls; the resident step with each capped plan's token chunks (no offload: what the
   chunks cost alone); then per cap the plan mmgen.placement picks for that budget (layer offload:
   blocks streamed from pinned host memory one block ahead; sequential CFG, FFN or block token
   chunks where the estimate needs them), or `--offload layer` forced. Every row's output is
   compared with the resident batch-2 step's ('bitwise' or the largest difference);
2. the whole mmgen pipeline (UMT5-XXL, the DiT, the Wan2.1 VAE, UniPC, --steps steps) per cap
   with --gpu-memory-gb = cap: seconds and measured peak per stage, the plan it chose;
3. diffusers WanTransformer3DModel resident (unless --no-diffusers-resident), then per cap in
   --diffusers-caps apply_group_offloading block_level (1 block / group; and leaf_level below 14B),
   with use_stream; per batch-1 forward.
Plus the pinned host-to-device bandwidth measured here and the byte floor of streaming the DiT's
blocks once per forward (a CFG step in batch 2 streams them once, sequential CFG twice). Each row
is printed as it is measured; the table last, then per capped row what limits it (the chunks'
cost without offload, the streaming on top, the byte floor's share). Ratios are against each
side's own resident row (diffusers per batch-1 forward, mmgen per CFG step).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
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
    reserved_gib: float | None = None
    floor_s: float | None = None  # streaming the blocks once per forward at the measured H2D rate
    exact: str = ""  # against the resident CFG step's output: 'bitwise' or the largest difference
    note: str = ""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="14b")
    parser.add_argument("--caps", default="24,12,8", help="GiB caps, comma-separated")
    parser.add_argument("--iters", type=int, default=2, help="timed calls per row")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up calls of each resident row")
    parser.add_argument(
        "--cap-warmup",
        type=int,
        default=1,
        help="untimed warm-up forwards of each capped row (0: the resident rows already ran its shapes)",
    )
    parser.add_argument("--steps", type=int, default=2, help="denoising steps of the pipeline rows")
    parser.add_argument("--offload", choices=("plan", "layer", "model"), default="plan")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--skip-diffusers", action="store_true")
    parser.add_argument(
        "--diffusers-caps", default=None, help="caps of diffusers' group-offloading rows (default: --caps)"
    )
    parser.add_argument("--no-diffusers-resident", action="store_true", help="skip diffusers' resident row")
    parser.add_argument(
        "--no-chunk-rows",
        action="store_true",
        help="skip the resident rows run with a capped plan's chunks (they split a cap's cost into chunking and streaming)",
    )
    parser.add_argument(
        "--no-batch1-row",
        action="store_true",
        help="skip the resident 2x batch-1 row (a quick re-check of the capped rows: --caps 24 alone)",
    )
    parser.add_argument("--skip-pipeline", action="store_true")
    parser.add_argument(
        "--no-cap-rows",
        action="store_true",
        help="skip the DiT-step rows under the caps (the pipeline rows still run under each cap)",
    )
    parser.add_argument(
        "--pipeline-resident",
        action="store_true",
        help="also run the pipeline with no cap and no offload: each stage's resident seconds and peak",
    )
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


def measure(
    row: Row,
    fn: Callable[[], torch.Tensor],
    device: torch.device,
    iters: int,
    *,
    warmup: int = 1,
    warm: Callable[[], object] | None = None,
    reference: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Median seconds of fn over `iters` timed calls after `warmup` untimed calls of `warm` (default fn);
    peak allocated and reserved GiB over all of them; every timed call's output compared with `reference`
    (the worst one reported: a fault of the first call after a placement must not hide behind a later
    call). Prints the row."""
    out = None
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(warmup):
            (warm or fn)()
        times: list[float] = []
        diffs: list[float] = []
        for _ in range(iters):
            synchronize(device)
            begin = time.perf_counter()
            out = fn()
            # Every stream done (side-stream copies included) before the time is taken or the output read.
            synchronize(device)
            times.append(time.perf_counter() - begin)
            if reference is not None:
                diffs.append(_difference(out, reference))
        row.seconds = statistics.median(times)
        if device.type == "cuda":
            row.peak_gib = torch.cuda.max_memory_allocated(device) / GIB
            row.reserved_gib = torch.cuda.max_memory_reserved(device) / GIB
        if diffs:
            worst = next((d for d in diffs if d != d), max(diffs))  # NaN wins
            row.exact = "bitwise" if worst == 0.0 else f"max|d| {worst:.2e}"
    except torch.OutOfMemoryError:
        row.note = "OOM"
    except Exception as err:  # a row that cannot run says why; the others go on
        row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"row: {_cells(row)}", flush=True)  # as measured: a run cut short still shows its rows
    return out


def _difference(out: torch.Tensor, reference: torch.Tensor) -> float:
    """0.0 when bitwise equal, else the largest absolute difference (NaN if either holds one; inf if
    the shapes differ)."""
    if out.shape != reference.shape:
        return float("inf")
    if torch.equal(out, reference):
        return 0.0
    return (out.float() - reference.float()).abs().max().item()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def diffusers_rows(config, inputs, device, caps, args) -> list[Row]:
    """diffusers' WanTransformer3DModel: resident (unless skipped), then per cap group offloading
    (block_level, 1 block per group, and leaf_level; both with use_stream); per batch-1 forward."""
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

    rows = []
    if not args.no_diffusers_resident:
        rows.append(Row("diffusers", "resident", "none", unit="forward"))
        measure(rows[-1], forward, device, args.iters, warmup=args.warmup)
    reference.to("cpu")
    for cap in caps:
        for kind in ("block_level", "leaf_level")[: 1 if args.model == "14b" else 2]:
            capped(device, cap)
            row = Row("diffusers", f"group {kind} + stream", f"{cap:g}", unit="forward")
            extra = {"num_blocks_per_group": 1} if kind == "block_level" else {}
            try:
                apply_group_offloading(
                    reference,
                    onload_device=device,
                    offload_type=kind,
                    use_stream=device.type == "cuda",
                    **extra,
                )
                measure(row, forward, device, args.iters, warmup=max(1, args.cap_warmup))
                _remove_group_offloading(reference)
            except Exception as err:  # report and go on
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


def set_chunks(model, plan: MemoryPlan | None) -> None:
    """The plan's FFN and block token chunks on every module that takes them (None: off)."""
    for module in model.modules():
        if hasattr(module, "token_chunk"):
            module.token_chunk = None if plan is None else plan.ffn_chunk
        if hasattr(module, "block_chunk"):
            module.block_chunk = None if plan is None else plan.block_chunk


def describe(plan: MemoryPlan) -> str:
    chunks = [f"ffn_chunk {plan.ffn_chunk}"] if plan.ffn_chunk else []
    chunks += [f"block_chunk {plan.block_chunk}"] if plan.block_chunk else []
    return f"cfg {plan.cfg}" + "".join(", " + c for c in chunks)


def mmgen_rows(model, inputs, device, caps, args, plans, h2d: float) -> tuple[list[Row], int]:
    """The resident CFG step (batch 2, then two batch-1 calls), the resident step with each capped plan's
    chunks (no offload: the chunks' own cost), then per cap the plan under layer offload. Every row's
    output is compared with the resident batch-2 step's."""
    attention = select_attention(
        args.attention, device=device, dtype=torch.bfloat16, head_dim=model.config.attention_head_dim
    )

    def forward(i: int | None) -> torch.Tensor:
        if i is None:
            return model(inputs.latents, inputs.timestep, inputs.text, attention=attention)
        return model(
            inputs.latents[i : i + 1], inputs.timestep[i : i + 1], inputs.text[i : i + 1], attention=attention
        )

    def step(batch: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with torch.no_grad():
                return forward(None) if batch else torch.cat([forward(0), forward(1)])

        return run

    def warm_one() -> None:  # a sequential step's shapes: one batch-1 forward
        with torch.no_grad():
            forward(0)

    model.to(device)
    rows = [Row("mmgen", "resident, CFG batch 2", "none")]
    reference = measure(rows[-1], step(True), device, args.iters, warmup=args.warmup)
    if not args.no_batch1_row:
        rows.append(Row("mmgen", "resident, CFG 2x batch 1", "none"))
        measure(
            rows[-1], step(False), device, args.iters, warmup=args.warmup, warm=warm_one, reference=reference
        )
    seen = set()
    for cap in caps if not args.no_chunk_rows else ():
        plan = plans[cap]
        key = (plan.cfg, plan.ffn_chunk, plan.block_chunk)
        if (plan.ffn_chunk or plan.block_chunk) and key not in seen:
            seen.add(key)
            set_chunks(model, plan)
            rows.append(Row("mmgen", f"resident, {describe(plan)}", "none"))
            batch = plan.cfg == "batch"
            measure(
                rows[-1], step(batch), device, args.iters,
                warmup=args.warmup, warm=None if batch else warm_one, reference=reference,
            )  # fmt: skip
    set_chunks(model, None)
    if args.no_cap_rows:  # no streamed rows: the pipeline rows place the model themselves
        return rows, module_bytes(model.blocks[0]) * len(model.blocks)
    side = {"text_encoder": torch.nn.Linear(1, 1), "vae": torch.nn.Linear(1, 1)}
    began = time.perf_counter()
    placement = OffloadPlacement("layer", experts=[model], device=device, **side)
    print(f"layer placement (blocks to pinned host memory): {time.perf_counter() - began:.1f} s", flush=True)
    streamed = placement.stream.block_bytes * len(model.blocks)
    for cap in caps if not args.no_cap_rows else ():
        plan = plans[cap]
        capped(device, cap)
        set_chunks(model, plan)
        batch = plan.cfg == "batch"
        row = Row("mmgen", f"layer, {describe(plan)}", f"{cap:g}")
        row.floor_s = (1 if batch else 2) * streamed / (h2d * 1e9) if h2d == h2d else None
        measure(
            row, step(batch), device, args.iters,
            warmup=args.cap_warmup, warm=None if batch else warm_one, reference=reference,
        )  # fmt: skip
        rows.append(row)
    capped(device, None)
    set_chunks(model, None)
    # The blocks leave pinned memory for nowhere (the pipeline rows load again from the CPU copy
    # they make; a 14B run skips them): a pageable 14B copy would cost host memory and time.
    placement.release(to=torch.device("meta") if args.skip_pipeline else torch.device("cpu"))
    return rows, streamed


def pipeline_rows(model, config, video, device, caps, args) -> list[Row]:
    """The whole pipeline per cap with gpu_memory_gb = cap; seconds and peak GiB per stage."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config as HFUMT5Config
    from transformers import UMT5EncoderModel

    from mmgen.default_model import VAE, WORDS
    from mmgen.loading.safetensors_dir import load_into_module
    from mmgen.loading.tokenizer import TextTokenizer, build_word_tokenizer
    from mmgen.loading.wan_components import GenerationDefaults
    from mmgen.models.umt5 import UMT5Config, UMT5Encoder
    from pipelines.memory import model_sizes, workload
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
    outputs: dict[str, tuple[str, np.ndarray]] = {}  # cap -> (latents sha256, frames)
    sizes = model_sizes((model,), encoder, vae)
    work = workload(
        pipe.latents_shape(height, width, frames),
        config.patch_size,
        guided=True,
        text_len=config.text_len,
        size=(frames, height, width),
    )
    for cap in list(caps) + ([None] if args.pipeline_resident else []):  # resident last: nothing to evict
        if cap is not None and device.type == "cuda":
            print(f"pipeline at {cap:g} GiB: {plan_memory(sizes, work, cap).describe()}", flush=True)
        capped(device, cap)
        row = Row("mmgen pipeline", "planned", "none" if cap is None else f"{cap:g}", unit="step")
        try:
            result = pipe(
                "a red fox in the snow",
                seed=1,
                gpu_memory_gb=None if cap is None else cap if device.type == "cuda" else 1e9,
                attention_backend=args.attention if device.type == "cuda" else "sdpa",
                progress=False,
            )
            plan = result.args["memory_plan"]
            chunks = "".join(
                f", {name} {plan[name]}" for name in ("ffn_chunk", "block_chunk") if plan.get(name)
            )
            row.mode = f"{plan['offload']}, cfg {plan['cfg']}{chunks}, decode {plan['decode']}" + (
                " (lossy)" if plan["lossy"] else ""
            )
            row.seconds = result.timings["denoise"] / args.steps
            row.peak_gib = result.memory.get("denoise")
            stages = ", ".join(f"{k} {v:.1f}s" for k, v in result.timings.items() if k != "total")
            peaks = ", ".join(f"{k} {v:.2f}" for k, v in result.memory.items())
            row.note = f"{stages}; peak GiB {peaks or 'n/a'}"
            outputs[row.cap] = (result.latents_sha256, result.frames)
        except torch.OutOfMemoryError:
            row.note = "OOM in " + _where(traceback.extract_tb(sys.exc_info()[2]))
            print(f"cap {row.cap}: {row.note}", flush=True)
            traceback.print_exc(limit=-6, file=sys.stdout)
        except Exception as err:
            row.note = f"{type(err).__name__}: {str(err).splitlines()[0][:140]}"
        rows.append(row)
    capped(device, None)
    # Each capped row against the resident row: the same latents (offload, sequential CFG and chunks are
    # exact), and how far its decode mode's frames are from the resident whole-frame decode.
    if "none" in outputs:
        sha, frames = outputs["none"]
        for row in rows:
            if row.cap in outputs and row.cap != "none":
                other_sha, other = outputs[row.cap]
                diff = np.abs(other.astype(np.int16) - frames.astype(np.int16))
                row.exact = (
                    f"latents {'=' if other_sha == sha else '!='}; frames max {diff.max()} levels, "
                    f"{(diff > 0).mean():.1e} differ, PSNR {_psnr(other, frames)}"
                )
    return rows


def _where(frames: traceback.StackSummary) -> str:
    """The innermost frame of mmgen's or the pipeline's code in a traceback: 'file:function'."""
    ours = [f for f in frames if "/mmgen/" in f.filename or "/pipelines/" in f.filename]
    last = (ours or list(frames))[-1]
    return f"{Path(last.filename).name}:{last.name}"


def _psnr(a: np.ndarray, b: np.ndarray) -> str:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return "inf" if mse == 0 else f"{10 * np.log10(255.0**2 / mse):.1f} dB"


HEADER = (
    "who",
    "mode",
    "cap GiB",
    "s",
    "per",
    "x resident",
    "peak GiB",
    "rsv GiB",
    "floor s",
    "exact",
    "note",
)
RESIDENT: dict[str, float | None] = {}  # filled by main before the table: who -> resident seconds


def _cells(r: Row) -> tuple[str, ...]:
    base = RESIDENT.get("diffusers" if r.who == "diffusers" else "mmgen")
    ratio = "-" if r.seconds is None or not base else f"{r.seconds / base:.3f}"
    number = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    return (
        r.who, r.mode, r.cap, number(r.seconds, ".3f"), r.unit, ratio, number(r.peak_gib, ".2f"),
        number(r.reserved_gib, ".2f"), number(r.floor_s, ".3f"), r.exact, r.note,
    )  # fmt: skip


def print_table(rows: list[Row], h2d: float, streamed: int, device_name: str) -> None:
    floor = streamed / (h2d * 1e9) if h2d == h2d else float("nan")
    print(f"\ndevice {device_name} | " + " | ".join(f"{k} {v}" for k, v in versions().items()))
    print(
        f"pinned host->device {h2d:.1f} GB/s; DiT blocks {streamed / GIB:.2f} GiB -> byte floor "
        f"{floor:.3f} s per forward (a sequential-CFG step streams them twice)"
    )
    table = [HEADER] + [_cells(r) for r in rows]
    widths = [max(len(str(t[i])) for t in table) for i in range(len(HEADER))]
    for t in table:
        print("  ".join(str(c).ljust(w) for c, w in zip(t, widths, strict=True)).rstrip())
    # What limits each capped mmgen row: its chunks (the resident step with the same chunks against
    # the plain resident step) and its streaming (the capped step against that chunked resident one).
    base = RESIDENT.get("mmgen")
    chunked = {
        r.mode.removeprefix("resident, "): r.seconds for r in rows if r.who == "mmgen" and r.cap == "none"
    }
    for r in rows:
        if r.who != "mmgen" or r.cap == "none" or r.seconds is None or not base:
            continue
        plan = r.mode.removeprefix("layer, ")
        alone = chunked.get(plan) or (chunked.get("CFG 2x batch 1") if "sequential" in plan else base)
        parts = [f"cap {r.cap}: {r.seconds / base:.3f}x resident"]
        if alone:
            parts.append(
                f"plan without offload {alone / base:.3f}x, streaming on top {r.seconds / alone:.3f}x"
            )
        if r.floor_s:
            parts.append(f"byte floor {r.floor_s:.2f} s/step = {r.floor_s / r.seconds:.1%} of the step")
        print("; ".join(parts))


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.tiny:
        sys.exit("no CUDA device: run on a GPU, or pass --tiny for a CPU smoke run")
    config, video = (TINY, (64, 96, 9)) if args.tiny else MODELS[args.model]
    caps = [float(c) for c in args.caps.split(",")] if not args.tiny else [1.0, 0.5]
    if args.diffusers_caps is None:
        diffusers_caps = caps
    else:
        diffusers_caps = [float(c) for c in args.diffusers_caps.split(",") if c.strip()]
    # Measured first: host-registered weights from the placement rows must not share its pinned buffer.
    h2d = h2d_bandwidth(device)
    inputs = make_inputs(config, video, device)
    rows: list[Row] = []
    torch.manual_seed(0)
    from mmgen.models.wan import WanDiT

    began = time.perf_counter()
    # Random bf16 weights made on the device; the model's own copy too (kept-fp32 modules cast).
    with torch.device(device), default_dtype(torch.bfloat16):
        source = WanDiT(config)
    tensors = {k: (v, RANDOM) for k, v in source.state_dict().items()}
    model = wan_dit_from_tensors(config, tensors, source=RANDOM, dtype=torch.bfloat16, device=device)
    del source, tensors
    capped(device, None)
    print(f"DiT built on {device} in {time.perf_counter() - began:.1f} s", flush=True)
    all_blocks = module_bytes(model.blocks[0]) * len(model.blocks)
    tokens = inputs.tokens
    plans = {}
    for cap in caps:
        if args.tiny:  # both kinds of plan through the harness: batch CFG, and sequential with chunks
            plans[cap] = (
                MemoryPlan(offload="layer")
                if cap == caps[0]
                else MemoryPlan(offload="layer", cfg="sequential", block_chunk=max(1, tokens // 3))
            )
        elif args.offload == "plan":
            plans[cap] = _dit_plan(model, tokens, cap)
        else:
            plans[cap] = MemoryPlan(offload="layer")
        print(f"cap {cap:g} GiB: {plans[cap].describe()}", flush=True)
    mm_rows, streamed = mmgen_rows(model, inputs, device, caps, args, plans, h2d)
    RESIDENT["mmgen"] = mm_rows[0].seconds
    rows += mm_rows
    if not args.skip_pipeline:
        try:
            rows += pipeline_rows(model, config, video, device, caps, args)
        except Exception as err:  # still print the step rows measured above
            print(f"pipeline rows failed: {' '.join(str(err).split())[:300]}")
    del model
    gc.collect()
    if not args.skip_diffusers and diffusers_caps is not None:
        try:
            d_rows = diffusers_rows(config, inputs, device, diffusers_caps, args)
            RESIDENT["diffusers"] = next((r.seconds for r in d_rows if r.cap == "none"), None)
            rows += d_rows
        except Exception as err:
            print(f"diffusers rows failed: {' '.join(str(err).split())[:300]}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print_table(rows, h2d, streamed or all_blocks, name)


def _dit_plan(model, tokens: int, cap: float) -> MemoryPlan:
    """The planner's layer-offload plan for the DiT step alone (text encoder and VAE not counted)."""
    from mmgen.placement.policy import ModelSizes, candidates

    config = model.config
    sizes = ModelSizes(
        expert_bytes=(module_bytes(model),), block_bytes=module_bytes(model.blocks[0]), blocks=len(model.blocks),
        text_encoder_bytes=0, vae_bytes=0, dim=config.dim, ffn_dim=config.ffn_dim,
        head_dim=config.attention_head_dim, dtype_bytes=2, text_dim=1, text_ffn_dim=1, vae_dtype_bytes=2,
    )  # fmt: skip
    work = Workload(tokens=tokens, guided=True, text_len=config.text_len, frames=1, height=16, width=16)
    try:
        return plan_memory(sizes, work, cap, offload="layer")
    except Exception as err:  # measure the most economical plan anyway: the cap may still hold it
        print(f"cap {cap:g}: {err}", flush=True)
        return [p for p in candidates(work, 1) if p.offload == "layer"][-1]


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"({time.perf_counter() - started:.0f} s)")
