"""The memory plan of a request and the planner that picks the least offloading that fits a budget.

A plan is a frozen value: offload (none | model | layer), how guided steps run (CFG as one batch of 2,
or the two branches one after the other), the FFN token chunk, the block token chunk (every per-token
op of a DiT block in token ranges, only the self-attention itself over the whole sequence), the decode
mode. Chunks run the same ops on row ranges: the values are the resident path's (module WanBlock). The planner walks the
candidates from fastest to most economical and takes the first whose estimated peak fits the budget;
when even the most economical one does not fit, the error names the budget and that minimum before
any weights move or any step runs.

Estimates come from shapes, not measurements: weights from the loaded modules' bytes, DiT
activations from tokens x width per block (the attention phase and the FFN phase, whichever is
larger), the text encoder's from its width, the decode's from the frame size. They are meant to be
conservative, not tight; the measured peaks are reported next to them in every result.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from mmgen.errors import ValidationError

OFFLOAD_MODES = ("none", "model", "layer")
# tiled is lossy (diffusers' spatial tiles blended); split: each rank of a parallel layout decodes a
# spatial band (mmgen.parallel.vae_decode: exact up to conv rounding; on one rank, diffusers' values);
# bandsN: one process decodes N such bands one after another (the same halo code: exact up to conv
# rounding, the full-resolution working set / N plus the halos), for budgets the whole frame misses.
DECODE_BANDS = {"bands2": 2, "bands4": 4, "bands8": 8}
DECODE_MODES = ("full", "frames", *DECODE_BANDS, "tiled", "split")
LOSSY_DECODES = frozenset({"tiled"})
GIB = 2**30
# Per-frame decoder working set at full resolution, in units of (4 frames x base_dim channels x H x W x
# bytes): fitted to the measured stage peaks of the frames decode on an H100 (RESULTS.md 9c: 720x1280
# bf16 11.86 GiB with ~0.75 GiB of weights resident, 480x832 4.75 GiB), about 17 units; diffusers'
# full decode fits 14 units plus its whole output video.
DECODE_WORKSET = 17
# A band's share of the full-resolution working set carries halos and the whole-frame latent-rate
# stages (conv_in, the mid block); measured halos are a few pixels, so a generous slack.
BAND_SLACK = 1.3
# diffusers' default spatial tile for the Wan VAE (tile_sample_min_height/width).
DECODE_TILE = 256
# Slack for what the estimate does not model (allocator rounding, small tensors, cuBLAS workspaces).
MARGIN_BYTES = GIB // 2
STREAM_AHEAD = 1
# Planned token chunks are multiples of this: chunk boundaries then fall on GEMM row-tile boundaries
# (CPU BLAS computes an odd tail of rows with another kernel, which can change the last bit).
CHUNK_ALIGN = 64


@dataclass(frozen=True)
class ModelSizes:
    """What a pipeline holds (bytes) and the widths its activations scale with.

    expert_bytes: each DiT expert in full; block_bytes: one DiT block (equal for every expert);
    blocks: blocks per expert.
    """

    expert_bytes: tuple[int, ...]
    block_bytes: int
    blocks: int
    text_encoder_bytes: int
    vae_bytes: int
    dim: int
    ffn_dim: int
    head_dim: int
    dtype_bytes: int
    text_dim: int
    text_ffn_dim: int
    vae_dtype_bytes: int
    vae_base_dim: int = 96
    text_block_bytes: int = 0  # one text encoder layer (streamed under layer offload)
    text_blocks: int = 0
    # FP8 weight copies of the requested FP8 linears (all experts); they exist only with offload none
    # (FP8 linears need resident weights), beside the bf16 weights, through every stage.
    fp8_bytes: int = 0

    @property
    def expert_rest_bytes(self) -> int:
        """The part of the largest expert outside its blocks (embeddings, head): resident under layer offload."""
        return max(self.expert_bytes) - self.blocks * self.block_bytes


@dataclass(frozen=True)
class Workload:
    """One request's sizes: DiT tokens per branch, branches (2 when guided), text length, output video."""

    tokens: int
    guided: bool
    text_len: int
    frames: int
    height: int
    width: int


@dataclass(frozen=True)
class MemoryPlan:
    """How one request uses GPU memory. estimate_gib: per stage, what the planner expected (None unplanned)."""

    offload: str = "none"
    cfg: str = "batch"
    ffn_chunk: int | None = None
    decode: str = "full"
    block_chunk: int | None = None
    prefetch_experts: bool = False
    budget_gib: float | None = None
    estimate_gib: tuple[tuple[str, float], ...] | None = None
    # Set where the plan's offload or budget cannot do what it says (e.g. on a CPU device, where the
    # weights are in host memory either way): recorded and printed, never silent.
    note: str | None = None

    def __post_init__(self) -> None:
        _check_choice("offload", self.offload, OFFLOAD_MODES)
        _check_choice("decode", self.decode, DECODE_MODES)
        _check_choice("cfg", self.cfg, ("batch", "sequential"))
        for name in ("ffn_chunk", "block_chunk"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValidationError(f"{name} = {value!r}: must be a positive integer or None")

    @property
    def lossy(self) -> bool:
        return self.decode in LOSSY_DECODES

    def record(self) -> dict:
        """JSON-ready, as results and manifests carry it."""
        record = asdict(self)
        record["estimate_gib"] = None if self.estimate_gib is None else dict(self.estimate_gib)
        record["lossy"] = self.lossy
        if self.note is None:
            del record["note"]  # the records of plans that apply stay as they were
        return record

    def describe(self) -> str:
        """One line for the console: 'memory plan: offload=layer cfg=sequential ...'."""
        parts = [f"offload={self.offload}", f"cfg={self.cfg}", f"ffn_chunk={self.ffn_chunk or 'off'}"]
        parts.append(f"block_chunk={self.block_chunk or 'off'}")
        parts.append(f"decode={self.decode}" + (" (lossy)" if self.lossy else ""))
        if self.budget_gib is not None:
            parts.append(f"budget={self.budget_gib:g} GiB")
        if self.estimate_gib:
            parts.append("estimate " + ", ".join(f"{k} {v:.2f}" for k, v in self.estimate_gib) + " GiB")
        if self.note is not None:
            parts.append(f"({self.note})")
        return "memory plan: " + " ".join(parts)


def check_offload(value: object) -> str:
    """An offload mode name, or a ValidationError naming the allowed ones."""
    return _check_choice("offload", value, OFFLOAD_MODES)


def check_budget(value: object) -> float | None:
    """A GPU memory budget in GiB (> 0), or None."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValidationError(f"gpu_memory_gb = {value!r}: must be a number > 0 (GiB)")
    return float(value)


def stage_peaks(sizes: ModelSizes, work: Workload, plan: MemoryPlan) -> dict[str, int]:
    """Estimated peak bytes of each stage (text_encode, denoise, decode: the timings' names) under `plan`."""
    experts = sum(sizes.expert_bytes)
    text, vae = sizes.text_encoder_bytes, sizes.vae_bytes
    if plan.offload == "none":
        resident = experts + text + vae + sizes.fp8_bytes
        weights = {"text_encode": resident, "denoise": resident, "decode": resident}
    elif plan.offload == "model":
        running = max(sizes.expert_bytes) * (2 if plan.prefetch_experts else 1)
        weights = {"text_encode": text, "denoise": running, "decode": vae}
    else:
        rest = sizes.expert_rest_bytes * len(sizes.expert_bytes)
        slots = (STREAM_AHEAD + 1) * sizes.block_bytes
        text_streamed = (
            text - sizes.text_blocks * sizes.text_block_bytes + (STREAM_AHEAD + 1) * sizes.text_block_bytes
        )
        weights = {"text_encode": rest + text_streamed, "denoise": rest + slots, "decode": rest + vae}
    activations = {
        "text_encode": _text_activations(sizes, work),
        "denoise": _dit_activations(sizes, work, plan),
        "decode": _decode_activations(sizes, work, plan.decode),
    }
    return {stage: weights[stage] + activations[stage] + MARGIN_BYTES for stage in weights}


def candidates(work: Workload, experts: int) -> list[MemoryPlan]:
    """Every plan the planner considers, fastest first (least offloading, then the activation savers)."""
    shapes: list[tuple[str, int | None, int | None]] = [("batch", None, None)]
    if work.guided:
        shapes.append(("sequential", None, None))
    cfg = shapes[-1][0]
    ffn_chunks = sorted({_chunk(work.tokens, parts) for parts in (2, 4, 8, 16)}, reverse=True)
    shapes += [(cfg, chunk, None) for chunk in ffn_chunks if chunk < work.tokens]
    # Last, the block chunk: every per-token op in ranges (the FFN's within them); the most launches.
    block_chunks = sorted({_chunk(work.tokens, parts) for parts in (4, 8, 16)}, reverse=True)
    shapes += [(cfg, None, chunk) for chunk in block_chunks if chunk < work.tokens]
    plans = []
    # An exact decode outranks speed: the lossy tiled decode comes only after every exact plan.
    for decode in ("frames", *DECODE_BANDS, "tiled"):
        for offload in OFFLOAD_MODES:
            # Activation savers cost every step; an expert switch without prefetch costs once.
            for cfg_mode, chunk, block in shapes:
                for prefetch in (True, False) if offload == "model" and experts > 1 else (False,):
                    plans.append(
                        MemoryPlan(
                            offload=offload,
                            cfg=cfg_mode,
                            ffn_chunk=chunk,
                            block_chunk=block,
                            decode=decode,
                            prefetch_experts=prefetch,
                        )
                    )
    return plans


def _chunk(tokens: int, parts: int) -> int:
    """tokens / parts rounded up to a multiple of CHUNK_ALIGN (at least one CHUNK_ALIGN)."""
    return max(1, math.ceil(tokens / parts / CHUNK_ALIGN)) * CHUNK_ALIGN


def plan_memory(
    sizes: ModelSizes, work: Workload, budget_gib: float, *, offload: str | None = None
) -> MemoryPlan:
    """The first candidate (optionally of one offload mode) whose every stage fits `budget_gib`.

    Raises a ValidationError naming the budget and the smallest estimated peak when none fits.
    """
    budget_gib = check_budget(budget_gib)
    pool = [p for p in candidates(work, len(sizes.expert_bytes)) if offload is None or p.offload == offload]
    best: tuple[int, MemoryPlan] | None = None
    for plan in pool:
        peaks = stage_peaks(sizes, work, plan)
        peak = max(peaks.values())
        if peak <= budget_gib * GIB:
            estimate = tuple((stage, round(value / GIB, 3)) for stage, value in peaks.items())
            return replace(plan, budget_gib=budget_gib, estimate_gib=estimate)
        if best is None or peak < best[0]:
            best = (peak, plan)
    assert best is not None
    peak, plan = best
    raise ValidationError(
        f"gpu_memory_gb = {budget_gib:g}: too small for this request "
        f"({work.frames} frames at {work.height}x{work.width}); the smallest plan "
        f"(offload={plan.offload}, cfg={plan.cfg}, ffn_chunk={plan.ffn_chunk}, "
        f"block_chunk={plan.block_chunk}, decode={plan.decode}) "
        f"needs about {peak / GIB:.2f} GiB" + (f" with offload={offload}" if offload is not None else "")
    )


def _text_activations(sizes: ModelSizes, work: Workload) -> int:
    rows = (2 if work.guided else 1) * work.text_len
    # hidden states, q/k/v/attention output, the FFN's gated inner pair; plus the L x L scores per head
    # are small at 512 tokens and folded into the factor.
    return rows * sizes.dtype_bytes * (8 * sizes.text_dim + 3 * sizes.text_ffn_dim)


def _dit_activations(sizes: ModelSizes, work: Workload, plan: MemoryPlan) -> int:
    batch = 2 if work.guided and plan.cfg == "batch" else 1
    tokens, dim, e = work.tokens, sizes.dim, sizes.dtype_bytes
    whole = batch * tokens * dim * e  # one [B, S, dim] tensor in the model dtype
    ffn_chunk = tokens if plan.ffn_chunk is None else min(plan.ffn_chunk, tokens)
    if plan.block_chunk is not None and plan.block_chunk < tokens:
        rows = batch * plan.block_chunk * dim * e  # one [B, chunk, dim]
        inner = batch * min(plan.block_chunk, ffn_chunk) * sizes.ffn_dim * e
        # Filling q/k/v: the input and q, k, v whole, one range's modulated input, fused q/k/v
        # output and normed q, k. Attending: the input, q, k, v and the output whole (FA needs q,
        # k, v whole). After: the input, the attention output and the block's output whole, one
        # range's projections, cross-attention q / output and residual pairs, and its FFN inner
        # activation twice (the matmul's and the GELU's when not fused).
        attention_phase = max(4 * whole + 6 * rows, 5 * whole)
        ffn_phase = 3 * whole + 8 * rows + 2 * inner
    else:
        # Self-attention holds the residual stream, the modulated input, the q/k/v projection, normed
        # q and k, and the attention output in the model dtype, plus one float32 row temporary.
        attention_phase = batch * tokens * dim * (8 * e + 4)
        # The residual, the input, the output and the inner activation twice (the matmul output and
        # the GELU's, when not fused) for one chunk of tokens.
        ffn_phase = 3 * whole + batch * ffn_chunk * sizes.ffn_dim * 2 * e
    rope = 2 * tokens * sizes.head_dim * 4
    text = 4 * batch * work.text_len * dim * e  # the projected text and one block's cross k / v
    latents = 64 * tokens * 4 * 4  # model input, predictions, scheduler state: float32, few channels
    return max(attention_phase, ffn_phase) + rope + text + latents


def _decode_activations(sizes: ModelSizes, work: Workload, decode: str) -> int:
    e = sizes.vae_dtype_bytes
    video = 3 * work.frames * work.height * work.width * e
    if decode == "tiled":
        area = min(work.height, DECODE_TILE) * min(work.width, DECODE_TILE)
        # the tiles' outputs, the blended rows and the concatenated result.
        return DECODE_WORKSET * 4 * sizes.vae_base_dim * area * e + 3 * video
    per_frame = DECODE_WORKSET * 4 * sizes.vae_base_dim * work.height * work.width * e
    if decode in DECODE_BANDS:  # one band at a time, its frames leaving as uint8 chunks
        return int(per_frame * BAND_SLACK / DECODE_BANDS[decode]) + 3 * 4 * work.height * work.width * e
    if decode == "frames":
        return per_frame + 3 * 4 * work.height * work.width * e  # one 4-frame chunk leaves at a time
    return per_frame + 3 * video  # the growing concatenation, its copy and the clamped result


def _check_choice(field: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValidationError(f"{field} = {value!r}: allowed values are {', '.join(allowed)}")
    return value  # type: ignore[return-value]
