"""What LoRAs cost per step (unfused kernels / fused, rank 32 and 128), to fuse and unfuse, and what the
4-step distillation preset saves end to end. Random bf16 weights, one GPU.

    python3 benchmarks/lora_step.py --no-e2e           # Wan2.1-1.3B, 480x832x81: model, per-linear, step tables
    python3 benchmarks/lora_step.py --model 14b --batch 1 --kernels auto --no-e2e   # Wan2.1-14B 720p rows
    python3 benchmarks/lora_step.py --tiny --attention flash:reference   # CPU smoke run (tiny sizes)

Tables, in order (all printed at the end):
1. Bytes model: per LoRA'd linear of one block (M tokens x batch, in -> out) and summed over the step,
   the extra HBM bytes and FLOPs each unfused kernel adds over the base GEMM, and the time those bytes
   take at --bandwidth (GB/s). The low-rank matrices and `low` [M, R] are tiny and left out.
   - separate: each layer re-reads x for its down-projection, the up-projection's addmm_ (beta=1)
     reads and writes y, and the FFN's GELU (in cuBLASLt's epilogue without LoRA) is a second read
     and write of y: extra x + 2y per layer, +2y for the FFN's first layer.
   - shared-down: q/k/v (and cross k/v) share one down-projection: x once per group.
   - fused-add: + the add and GELU in one Triton pass over y: x + 2y per group.
   - epilogue: the up-projection inside the main GEMM (Triton): x once per group, y written once;
     its cost beyond that is how far the Triton main loop is from cuBLAS (the per-linear table's
     'triton GEMM, R=0' column shows exactly that).
   - concat: where a norm kernel writes x (self q/k/v stacked, cross q, FFN up) or the attention
     writes it (self o, cross o: FA3 writes into a given buffer) into a buffer with R spare
     columns, h = x D^T goes into them in place and one cuBLAS GEMM over [x | h] against [W | U]
     makes y (bias and GELU epilogue kept): x once per group, nothing more; elsewhere (FFN down,
     cross k/v) it is fused-add. Its memory line: the [W | U] matrices are the
     weights' own storage (mmgen.lora.pack), so they cost the U columns only; a separate copy
     would cost the weights of those layers again (printed for the model).
2. Attention-output table (CUDA with an impl that writes into a given buffer: FA3): the self- and
   cross-attention of one block at the step's shape, output as the kernel allocates it against
   written into padded rows [B, S, dim + 32] (what the o-projections' concat kernel reads): ms, and
   whether the bits are the same. The padded rows should cost nothing.
3. Per-linear table: each linear of one block at its real shape (CUDA events, median of --micro-iters
   after warm-up and autotuning): base (the model's own call: F.linear, or addmm+GELU epilogue for the
   FFN) and each kernel at each rank, ms and overhead ('h=xD^T only': the concat cell's first GEMM
   alone, the read of x that a producer computing h itself would save); 'x n' sums one block's linears; the rel. error
   column is each kernel's max |out - separate| / (|separate| + 1) (bf16 rounding only).
4. Step table: one step of mmgen's WanDiT with stacked q/k/v (batch --batch: 2 = one CFG step),
   attention 'auto'; a LoRA on every block Linear (self/cross q, k, v, o and both FFN layers, as
   the lightx2v distillation LoRAs cover) at each rank, unfused with each kernel of --kernels
   (LowRankLinear beside the weight; set_low_rank_kernel switches between them) and fused (merged).
   ms = median of --iters CUDA-event timings after --warmup calls; overhead against the no-LoRA row
   (targets: <= 3% unfused at rank 32, 0 fused). Apply / remove seconds: apply_loras (unfused: the
   modules swapped; fused: merged in float32, originals copied to host memory) and remove().
5. End-to-end table (--e2e, on by default): pipelines.denoise over the DiT with text embeddings at
   hand: the distill-4step preset (4 steps, FlowMatch Euler shift 5, no CFG: batch 1) with a fused
   rank-64 LoRA, against UniPC with --cfg-steps steps of CFG 5 (batch 2). Text encoding (~50 ms) and
   VAE decode (bf16 480p 1.8 s, 720p 4.2 s, see /work/shared/GPU.md) are the same for both and not
   included. With --cfg-run fewer than --cfg-steps, the CFG run is extrapolated (marked).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from torch import nn  # noqa: E402

from mmgen.attention import select_attention  # noqa: E402
from mmgen.attention.metadata import AttentionMetadata  # noqa: E402
from mmgen.attention.selection import BACKEND_NAMES  # noqa: E402
from mmgen.errors import ValidationError  # noqa: E402
from mmgen.layers.low_rank import (  # noqa: E402
    CONCAT_ALIGN,
    LowRankLinear,
    check_kernel,
    concat_columns,
    low_rank_linear,
    set_low_rank_kernel,
)
from mmgen.lora import LoRARequest, apply_loras, parse_lora  # noqa: E402
from mmgen.lora.names import takes_padded_input  # noqa: E402
from mmgen.lora.pack import pack_concat, unpack_concat  # noqa: E402
from mmgen.lora.readers import LoRAFile  # noqa: E402
from mmgen.models.wan import WanConfig, WanDiT  # noqa: E402
from mmgen.parallel.layout import ParallelLayout  # noqa: E402
from mmgen.progress import NullProgress  # noqa: E402
from pipelines.denoise import (  # noqa: E402
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
    """Median ms of model(*x) over iters calls after warmup calls."""
    return time_call(lambda: model(*x, attention=attention), device, warmup, iters)


KERNELS = ("separate", "shared-down", "fused-add", "epilogue", "concat")


@dataclass(frozen=True)
class LinearShape:
    """One kind of LoRA'd linear in a block: `layers` Linears (in -> out each) stacked on one input."""

    name: str
    tokens: int  # M: rows of x (batch x sequence)
    dim_in: int
    dim_out: int  # per layer
    layers: int = 1
    gelu: bool = False
    # x written by a norm kernel or the attention (FA3): it can carry the concat kernel's spare columns
    padded: bool = False


def linear_shapes(config: WanConfig, size: tuple[int, int, int], batch: int) -> list[LinearShape]:
    """The LoRA'd linears of one block with stacked q/k/v (fuse_projections), at this video size."""
    height, width, frames = size
    pt, ph, pw = config.patch_size
    tokens = batch * (((frames - 1) // 4 + 1) // pt) * (height // 8 // ph) * (width // 8 // pw)
    text, dim, ffn = batch * config.text_len, config.dim, config.ffn_dim
    return [
        LinearShape("self q/k/v (stacked)", tokens, dim, dim, 3, padded=True),
        LinearShape("self o", tokens, dim, dim, padded=True),
        LinearShape("cross q", tokens, dim, dim, padded=config.cross_attn_norm),
        LinearShape("cross k/v (stacked, text)", text, dim, dim, 2),
        LinearShape("cross o", tokens, dim, dim, padded=True),
        LinearShape("ffn up (+GELU)", tokens, dim, ffn, gelu=True, padded=True),
        LinearShape("ffn down", tokens, ffn, dim),
    ]


def extra_bytes(shape: LinearShape, kernel: str) -> int:
    """HBM bytes (bf16) a kernel adds over the base GEMM for one linear kind (see the module docstring)."""
    x = 2 * shape.tokens * shape.dim_in
    y = 2 * shape.tokens * shape.dim_out * shape.layers
    if kernel == "separate":
        return shape.layers * x + 2 * y + (2 * y if shape.gelu else 0)
    if kernel == "shared-down":
        return x + 2 * y + (2 * y if shape.gelu else 0)
    if kernel == "fused-add" or (kernel == "concat" and not shape.padded):
        return x + 2 * y
    return x  # epilogue; concat on a padded input (h [M, R] and the R more columns left out)


def extra_flops(shape: LinearShape, kernel: str, rank: int) -> int:
    down = 2 * shape.tokens * shape.dim_in * rank * shape.layers
    up = 2 * shape.tokens * rank * shape.dim_out * shape.layers
    if kernel in ("fused-add", "epilogue", "concat") and shape.layers > 1:
        up *= shape.layers  # a block-diagonal up matrix over the group: zeros multiplied too
    return down + up


def concat_memory(config: WanConfig, ranks: list[int]) -> str:
    """What the concat kernel's [W | U] matrices cost: as the weights' own storage (built) or as a copy."""
    shapes = [s for s in linear_shapes(config, (16, 16, 1), 1) if s.padded]
    weights = config.num_layers * sum(2 * s.layers * s.dim_out * s.dim_in for s in shapes)
    columns = {
        r: config.num_layers * sum(2 * s.layers * r * (s.layers * s.dim_out + s.dim_in) for s in shapes)
        for r in ranks
    }
    spare = ", ".join(f"+{columns[r] / 2**20:.0f} MiB at rank {r}" for r in ranks)
    return (
        f"concat weights: the [W | U] matrices are the weights' storage (one copy): {spare} (U columns and "
        f"stacked D); a separate copy would add {weights / 2**30:.2f} GiB (the packed layers' weights)"
    )


def bytes_table(config, size, batch, ranks, bandwidth) -> list[str]:
    shapes = linear_shapes(config, size, batch)
    blocks = config.num_layers
    lines = [
        f"\nBytes model: extra HBM traffic per block (GB) over the base GEMMs, and for the whole step "
        f"({blocks} blocks) at {bandwidth:.0f} GB/s; base linear FLOPs per step "
        f"{blocks * sum(2 * s.tokens * s.dim_in * s.dim_out * s.layers for s in shapes) / 1e12:.1f} TFLOP",
        "| linear | M | in -> out | " + " | ".join(f"{k} GB" for k in KERNELS) + " |",
        "|---|---|---|" + "---|" * len(KERNELS),
    ]
    for shape in shapes:
        cells = " | ".join(f"{extra_bytes(shape, k) / 1e9:.2f}" for k in KERNELS)
        out = f"{shape.layers}x{shape.dim_out}" if shape.layers > 1 else str(shape.dim_out)
        lines.append(f"| {shape.name} | {shape.tokens} | {shape.dim_in} -> {out} | {cells} |")
    total = {k: blocks * sum(extra_bytes(s, k) for s in shapes) for k in KERNELS}
    lines.append("| step: GB | | | " + " | ".join(f"{total[k] / 1e9:.1f}" for k in KERNELS) + " |")
    lines.append(
        "| step: ms at bandwidth | | | "
        + " | ".join(f"{total[k] / bandwidth / 1e6:.1f}" for k in KERNELS)
        + " |"
    )
    for rank in ranks:
        flops = {k: blocks * sum(extra_flops(s, k, rank) for s in shapes) for k in KERNELS}
        lines.append(
            f"| step: extra TFLOP, rank {rank} | | | "
            + " | ".join(f"{flops[k] / 1e12:.2f}" for k in KERNELS)
            + " |"
        )
    lines.append(concat_memory(config, ranks))
    return lines


def _layers(shape: LinearShape, weight, bias, rank: int, device) -> list[nn.Module]:
    """LowRankLinear views of one stacked weight, each with a random rank-`rank` pair (bf16)."""
    gen = torch.Generator(device).manual_seed(rank)
    layers = []
    for index in range(shape.layers):
        rows = slice(index * shape.dim_out, (index + 1) * shape.dim_out)
        base = nn.Linear(shape.dim_in, shape.dim_out, device="meta")
        base.weight = nn.Parameter(weight[rows], requires_grad=False)
        base.bias = nn.Parameter(bias[rows], requires_grad=False)
        kw = dict(device=device, dtype=weight.dtype, generator=gen)
        down = torch.randn(rank, shape.dim_in, **kw) * shape.dim_in**-0.5
        up = torch.randn(shape.dim_out, rank, **kw) * 0.01
        layers.append(LowRankLinear(base, down, up))
    return layers


def time_call(call, device, warmup: int, iters: int) -> float:
    """Median ms of call() (CUDA events on a GPU, perf_counter elsewhere)."""
    times = []
    with torch.no_grad():
        for index in range(warmup + iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end)
            else:
                tick = time.perf_counter()
                call()
                elapsed = (time.perf_counter() - tick) * 1e3
            if index >= warmup:
                times.append(elapsed)
    return statistics.median(times)


def attention_out_table(config, size, batch, device, attention, args) -> list[str]:
    """Self- and cross-attention of one block: output as allocated vs written into padded rows."""
    name = f"{attention.name}:{attention.provider}"
    if not getattr(attention, "writes_out", False):
        return [
            f"\nAttention-output table: skipped ({name} does not write into a given buffer: o runs fused-add)"
        ]
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    dim, spare = heads * head_dim, 32
    seq = linear_shapes(config, size, batch)[0].tokens // batch
    gen = torch.Generator(device).manual_seed(2)

    def rand(length: int) -> torch.Tensor:
        return torch.randn(batch, length, heads, head_dim, device=device, generator=gen).to(torch.bfloat16)

    q = rand(seq)
    text = torch.tensor([config.text_len, config.text_len // 3][:batch], device=device)
    cases = (
        ("self (dense)", rand(seq), rand(seq), AttentionMetadata()),
        (
            "cross (text, padded keys)",
            rand(config.text_len),
            rand(config.text_len),
            AttentionMetadata.from_lengths(None, text),
        ),
    )
    lines = [
        f"\nAttention-output table ({name}, batch {batch}): ms as allocated / into padded rows [B, S, {dim} + {spare}]",
        "| attention | q | allocated ms | padded rows ms | same bits |",
        "|---|---|---|---|---|",
    ]
    for label, k, v, meta in cases:
        buffer = torch.empty(batch, seq, dim + spare, device=device, dtype=torch.bfloat16)
        view = buffer[..., :dim].unflatten(2, (heads, head_dim))
        with torch.no_grad():
            same = torch.equal(
                attention(q, k, v, meta, out=view).flatten(2), attention(q, k, v, meta).flatten(2)
            )
        plain = time_call(
            lambda k=k, v=v, m=meta: attention(q, k, v, m), device, args.micro_warmup, args.micro_iters
        )
        padded = time_call(
            lambda k=k, v=v, m=meta, o=view: attention(q, k, v, m, out=o),
            device,
            args.micro_warmup,
            args.micro_iters,
        )
        lines.append(f"| {label} | {tuple(q.shape)} | {plain:.3f} | {padded:.3f} | {same} |")
    return lines


def micro_table(config, size, batch, device, args) -> list[str]:
    """Each LoRA'd linear of one block at its real shape: base, then each kernel at each rank."""
    head = ["base", "triton GEMM R=0"] + [
        name
        for r in args.ranks
        for k in KERNELS
        for name in _kernel_names(k, r, args.concat_aligns) + ([f"h=xD^T only r{r}"] if k == "concat" else [])
    ]
    lines = [
        f"\nPer-linear table (batch {batch}): ms (overhead vs base) [max rel. error vs separate]; "
        f"last row: one block's linears x {config.num_layers} blocks (the step's linear time, its extra ms)",
        "| linear | " + " | ".join(head) + " |",
        "|---|" + "---|" * len(head),
    ]
    sums = {name: 0.0 for name in head}
    for index, shape in enumerate(linear_shapes(config, size, batch)):
        times, cells = _micro_row(shape, index, device, args)
        for name in head:
            sums[name] += times.get(name, float("nan"))
        lines.append(
            f"| {shape.name} M={shape.tokens} | " + " | ".join(cells.get(h, "-") for h in head) + " |"
        )
    blocks, base = config.num_layers, sums["base"] * config.num_layers
    step = [f"{base:.1f}"] + [
        f"{sums[n] * blocks:.1f}" + ("" if n.startswith("h=") else f" ({sums[n] * blocks - base:+.1f})")
        for n in head[1:]
    ]
    lines.append(f"| x {blocks} blocks (step) | " + " | ".join(step) + " |")
    return lines


def _micro_row(shape: LinearShape, seed: int, device, args) -> tuple[dict[str, float], dict[str, str]]:
    """ms and table cells of one linear kind: base, Triton main loop alone, each kernel at each rank."""
    gen = torch.Generator(device).manual_seed(seed)
    kw = dict(device=device, dtype=torch.bfloat16, generator=gen)
    x = torch.randn(shape.tokens, shape.dim_in, **kw)
    weight = torch.randn(shape.layers * shape.dim_out, shape.dim_in, **kw) * shape.dim_in**-0.5
    bias = torch.randn(shape.layers * shape.dim_out, **kw) * 0.02
    act = "gelu_tanh" if shape.gelu else None
    if shape.gelu and device.type == "cuda":  # the model's base path: bias and GELU in cuBLASLt's epilogue
        base_call = lambda: torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    else:
        base_call = lambda: low_rank_linear(x, weight, bias, (), act)  # F.linear (+ GELU)
    times = {"base": time_call(base_call, device, args.micro_warmup, args.micro_iters)}
    cells = {"base": f"{times['base']:.3f}"}

    def measure(name: str, call, reference: torch.Tensor | None) -> torch.Tensor | None:
        try:
            with torch.no_grad():
                out = call().float()
            error = (
                ""
                if reference is None
                else f" [{((out - reference).abs() / (reference.abs() + 1)).max().item():.0e}]"
            )
            ms = time_call(call, device, args.micro_warmup, args.micro_iters)
        except Exception as failure:  # a kernel that fails is a table cell, not the end of the run
            cells[name] = f"failed: {type(failure).__name__}: {str(failure).splitlines()[0][:60]}"
            return None
        times[name] = ms
        cells[name] = f"{ms:.3f} ({100 * (ms / times['base'] - 1):+.1f}%){error}"
        return out

    if device.type == "cuda":
        from mmgen.layers.triton_low_rank import linear_plus_low_rank

        # Rank 0 as empty views of real allocations (no null data pointers handed to Triton).
        low = torch.zeros(shape.tokens, 16, device=device, dtype=x.dtype)[:, :0]
        up = torch.zeros(weight.shape[0], 16, device=device, dtype=x.dtype)[:, :0]
        measure("triton GEMM R=0", lambda: linear_plus_low_rank(x, weight, bias, low, up, act), None)
    for rank in args.ranks:
        layers = _layers(shape, weight, bias, rank, device)
        reference = None
        for kernel in KERNELS:
            name = f"{kernel} r{rank}"
            if kernel == "concat" and not shape.padded:  # no padded input there: it runs fused-add
                for name in _kernel_names(kernel, rank, args.concat_aligns):
                    if f"fused-add r{rank}" in times:
                        times[name] = times[f"fused-add r{rank}"]
                    cells[name] = "= fused-add"
                times[f"h=xD^T only r{rank}"] = 0.0  # part of fused-add's cell there
                continue
            set_low_rank_kernel(nn.ModuleList(layers), kernel)
            if kernel == "concat":
                for name, align in zip(
                    _kernel_names(kernel, rank, args.concat_aligns), args.concat_aligns, strict=True
                ):
                    packed, holders, padded = _pack_group(layers, x, weight, align)
                    if holders:
                        call = lambda p=padded, group=layers: low_rank_linear(p, weight, bias, group, act)
                        measure(name, call, reference)
                        if name == f"concat r{rank}":  # the concat cell's first GEMM alone (x read for h)
                            down, k = holders[0].concat_down, shape.dim_in
                            h_only = lambda p=padded, d=down, k=k: torch.mm(p[:, :k], d.t(), out=p[:, k:])
                            measure(f"h=xD^T only r{rank}", h_only, None)
                    else:
                        cells[name] = "failed: the group did not pack"
                    unpack_concat(packed, holders)  # the weights back in their own storage for the next one
                continue
            out = measure(name, lambda group=layers: low_rank_linear(x, weight, bias, group, act), reference)
            reference = out if kernel == "separate" else reference
    return times, cells


def _kernel_names(kernel: str, rank: int, aligns: list[int]) -> list[str]:
    """Table names of a kernel at a rank: concat once per spare-column alignment (the first unmarked)."""
    if kernel != "concat":
        return [f"{kernel} r{rank}"]
    return [f"concat r{rank}" + ("" if index == 0 else f" a{align}") for index, align in enumerate(aligns)]


class _Group(nn.Module):
    """One linear kind's layers with their stacked weight, for mmgen.lora.pack (it re-points both)."""

    def __init__(self, layers: list[nn.Module], weight: torch.Tensor) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.register_buffer("stacked", weight)


def _pack_group(layers, x, weight, align: int) -> tuple[_Group, list, torch.Tensor]:
    """Pack the layers' [W | U] (mmgen.lora.pack) and a padded copy of x as a norm kernel would write it."""
    group = _Group(layers, weight)
    holders = pack_concat(group, lambda names: True, align)
    spare = concat_columns(layers, weight)
    padded = torch.empty(x.shape[0], x.shape[1] + spare, device=x.device, dtype=x.dtype)
    padded[:, : x.shape[1]] = x
    return group, holders, padded


def step_table(model, attention, config, size, device, args) -> list[str]:
    x = inputs(config, size, args.batch, device)
    base = time_step(model, attention, x, device, args.warmup, args.iters)
    lines = [
        f"\nStep table (batch {args.batch}{', one CFG step' if args.batch == 2 else ''})",
        "| LoRA | mode / kernel | ms / step | overhead | apply s | remove s |",
        "|---|---|---|---|---|---|",
        f"| none | - | {base:.1f} | - | - | - |",
    ]
    print(lines[-1], flush=True)
    notes: list[str] = []
    for rank in args.ranks:
        lora = synthetic_lora(model, rank, device)
        request = LoRARequest(lora.path, 1.0)
        for mode in ("unfused", "fused"):
            sync(device)
            tick = time.perf_counter()
            applied = apply_loras([model], [(request, lora)], mode=mode)
            sync(device)
            apply = time.perf_counter() - tick
            if mode == "unfused":
                if args.concat_aligns[0] != CONCAT_ALIGN:
                    _repack(applied, args.concat_aligns[0])
                notes.append(f"rank {rank} unfused: {packed_note(applied)}")
            for kernel in args.kernels if mode == "unfused" else ("-",):
                if mode == "unfused":
                    set_low_rank_kernel(model, kernel)
                try:
                    ms = time_step(model, attention, x, device, args.warmup, args.iters)
                    cell = f"{ms:.1f} | {100.0 * (ms / base - 1.0):+.2f}%"
                except Exception as error:  # one failing kernel must not lose the other rows
                    cell = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:60]} | -"
                lines.append(f"| rank {rank} | {mode} {kernel} | {cell} | {apply:.3f} | REMOVE |")
                print(lines[-1], flush=True)
                if kernel == "concat":
                    for align in args.concat_aligns[1:]:
                        cell = _repacked_row(model, attention, x, applied, align, base, device, args)
                        lines.append(
                            f"| rank {rank} | {mode} concat, spare columns to {align} | {cell} | - | - |"
                        )
                        print(lines[-1], flush=True)
                    _repack(applied, args.concat_aligns[0])
            tick = time.perf_counter()
            applied.remove()
            sync(device)
            remove = time.perf_counter() - tick
            lines = [line.replace("REMOVE", f"{remove:.3f}") for line in lines]
        del lora
    return lines + notes


def _repack(applied, align: int) -> None:
    """Pack the applied LoRAs' concat groups again with spare columns rounded up to `align`."""
    for index, (expert, holders) in enumerate(applied.packed):
        unpack_concat(expert, holders)
        applied.packed[index] = (expert, pack_concat(expert, takes_padded_input, align))


def _repacked_row(model, attention, x, applied, align: int, base: float, device, args) -> str:
    """The step with the concat groups packed at another alignment: 'ms | overhead' cells."""
    try:
        _repack(applied, align)
        ms = time_step(model, attention, x, device, args.warmup, args.iters)
        return f"{ms:.1f} | {100.0 * (ms / base - 1.0):+.2f}%"
    except Exception as error:
        return f"failed: {type(error).__name__}: {str(error).splitlines()[0][:60]} | -"


def packed_note(applied) -> str:
    """How many groups got the concat kernel's [W | U] matrix, and what its U columns and D stacks cost."""
    holders = [holder for _, group in applied.packed for holder in group]
    extra = sum(
        (h.concat_weight.shape[1] - h.in_features) * h.concat_weight.shape[0] * h.concat_weight.element_size()
        + h.concat_down.numel() * h.concat_down.element_size()
        for h in holders
    )
    return f"{len(holders)} groups packed for concat (U columns + D stacks {extra / 2**20:.1f} MiB, weights not copied)"


def inplace_check(device: torch.device) -> str:
    """Whether torch.mm(out= the spare columns of a row buffer) runs without a copy: on CUDA no copy or
    elementwise kernel besides the GEMM (on CPU, the --tiny dry run, no aten copy op). Also probed:
    the FFN up-projection's bias + GELU epilogue (torch._addmm_activation) with out= the first columns
    of a padded row buffer, which FFN down's concat would need: one kernel, or a copy / a separate GELU."""
    cuda = device.type == "cuda"
    kw = dict(device=device, dtype=torch.bfloat16)
    rows = 8192 if cuda else 64
    buffer, down = torch.randn(rows, 1536 + 32, **kw), torch.randn(32, 1536, **kw)
    names = _profiled_ops(lambda: torch.mm(buffer[:, :1536], down.t(), out=buffer[:, 1536:]), device)
    lines = [
        f"mm into the spare columns [{rows}, 1536] -> [:, 1536:1568] ({device.type}): {_verdict(names)}; ops: {names}"
    ]
    x, weight, bias = torch.randn(rows, 1536, **kw), torch.randn(2048, 1536, **kw), torch.randn(2048, **kw)
    padded = torch.empty(rows, 2048 + 32, **kw)
    try:
        call = lambda: torch._addmm_activation(bias, x, weight.t(), use_gelu=True, out=padded[:, :2048])
        names = _profiled_ops(call, device)
        lines.append(
            f"addmm + GELU epilogue into padded rows [{rows}, 2048 + 32]: {_verdict(names)}; ops: {names}"
        )
    except Exception as error:
        lines.append(
            f"addmm + GELU epilogue into padded rows: failed: {type(error).__name__}: {str(error)[:80]}"
        )
    return "\n".join(lines)


def _profiled_ops(call, device: torch.device) -> list[str]:
    """Names of the kernels (CUDA) or aten ops (CPU) one call of `call` runs, after two warm-up calls."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    for _ in range(2):
        call()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        call()
        sync(device)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return sorted({e.name for e in prof.events() if e.device_type == kind})


def _verdict(names: list[str]) -> str:
    extra = [n for n in names if any(word in n.lower() for word in ("copy", "elementwise", "clone", "gelu"))]
    return "in place (no copy)" if names and not extra else f"COPIES or extra passes ({len(extra)} ops)"


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


def e2e_table(model, attention, config, size, shift, device, args) -> list[str]:
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
    return [
        "\nEnd-to-end denoise (text encoder and VAE excluded)",
        "| run | DiT calls | batch | denoise s | speed-up |",
        "|---|---|---|---|---|",
        f"| {args.cfg_steps}-step UniPC, CFG 5{mark} | {args.cfg_steps} | 2 | {slow:.2f} | 1.00x |",
        f"| distill-4step + fused rank-64 LoRA | 4 | 1 | {fast:.2f} | {slow / fast:.1f}x |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("1.3b", "14b"), default="1.3b")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run of the harness (tiny config)")
    parser.add_argument("--ranks", type=lambda s: [int(r) for r in s.split(",")], default=[32, 128])
    parser.add_argument(
        "--kernels",
        type=lambda s: s.split(","),
        default=list(KERNELS),
        help=f"unfused kernels for the step table, comma-separated (of auto,{','.join(KERNELS)})",
    )
    parser.add_argument("--batch", type=int, choices=(1, 2), default=2, help="2: one CFG step (default)")
    parser.add_argument("--warmup", type=int, default=None, help="step table: default 3 (14b: 1)")
    parser.add_argument("--iters", type=int, default=None, help="step table: default 10 (14b: 3)")
    parser.add_argument("--micro-warmup", type=int, default=3, help="per-linear table (after autotuning)")
    parser.add_argument("--micro-iters", type=int, default=10)
    parser.add_argument(
        "--bandwidth", type=float, default=3000.0, help="GB/s for the bytes model (H100 ~3000)"
    )
    parser.add_argument(
        "--attention",
        default="auto",
        choices=BACKEND_NAMES,
        help="attention backend (auto: FA3 on the GPU host; the CPU dry run takes flash:reference to write padded rows)",
    )
    parser.add_argument(
        "--concat-aligns",
        type=lambda s: [int(a) for a in s.split(",")],
        default=[CONCAT_ALIGN],
        help=f"concat: spare columns rounded to each of these (multiples of {CONCAT_ALIGN}; the first is "
        "the step table's 'concat' row, the others get rows of their own and per-linear cells)",
    )
    parser.add_argument("--no-micro", dest="micro", action="store_false", help="skip the per-linear table")
    parser.add_argument("--no-e2e", dest="e2e", action="store_false", help="skip the end-to-end table")
    parser.add_argument("--no-steps", dest="steps", action="store_false", help="skip the step table")
    parser.add_argument("--cfg-steps", type=int, default=50)
    parser.add_argument("--cfg-run", type=int, default=None, help="steps of the CFG run actually timed")
    args = parser.parse_args()
    for kernel in args.kernels:
        try:
            check_kernel(kernel)
        except ValidationError as error:  # one line, before anything is built
            parser.error(str(error))
    if any(align <= 0 or align % CONCAT_ALIGN for align in args.concat_aligns):
        parser.error(f"--concat-aligns {args.concat_aligns}: positive multiples of {CONCAT_ALIGN}")
    name = "tiny" if args.tiny else args.model
    config, size, shift = MODELS[name]
    if args.cfg_run is None:
        args.cfg_run = 5 if name == "14b" else args.cfg_steps
    # A 14B 720p CFG step takes ~20 s: fewer timed calls keep each table within a 10-minute run.
    args.warmup = args.warmup if args.warmup is not None else (1 if name == "14b" else 3)
    args.iters = args.iters if args.iters is not None else (3 if name == "14b" else 10)
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:
        args.warmup, args.iters, args.micro_warmup, args.micro_iters = 1, 2, 1, 2
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"model {name} ({config.num_layers} layers, dim {config.dim}, ffn {config.ffn_dim}), video "
        f"{size[0]}x{size[1]}x{size[2]}, batch {args.batch}, bf16, {gpu}, torch {torch.__version__}",
        flush=True,
    )
    tables = bytes_table(config, size, args.batch, args.ranks, args.bandwidth)
    try:
        tables.append(inplace_check(device))
    except Exception as error:  # a profiler problem must not cost the tables
        tables.append(f"mm in-place check failed: {type(error).__name__}: {str(error).splitlines()[0][:80]}")
    print(tables[-1], flush=True)
    attention = select_attention(
        args.attention, device=device, dtype=torch.bfloat16, head_dim=config.attention_head_dim
    )
    try:  # before the model exists, as the per-linear table
        tables += attention_out_table(config, size, args.batch, device, attention, args)
    except Exception as error:  # a failure here must not cost the other tables
        tables.append(
            f"attention-output table failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
        )
    print("\n".join(tables[-5:]), flush=True)
    if args.micro:  # before the model exists: the largest activations fit beside nothing else
        tick = time.perf_counter()
        tables += micro_table(config, size, args.batch, device, args)
        print(
            f"per-linear table done in {time.perf_counter() - tick:.1f} s (autotuning included)", flush=True
        )
    if args.steps or args.e2e:
        tick = time.perf_counter()
        model = build_model(config, device)
        writes = getattr(attention, "writes_out", False)
        print(
            f"model built in {time.perf_counter() - tick:.1f} s; attention {attention.name}:{attention.provider} "
            f"({'writes into padded rows: o-projections on concat' if writes else 'o-projections on fused-add'})"
        )
        if args.steps:
            tables += step_table(model, attention, config, size, device, args)
        if args.e2e:
            tables += e2e_table(model, attention, config, size, shift, device, args)
    print("\n".join(tables))


if __name__ == "__main__":
    main()
