"""Per-rank work of sequence / CFG parallel layouts on ONE GPU, bytes per rank, projected step time.

Question: how fast could a guided Wan step be on 2, 4 and 8 GPUs with mmgen.parallel, before any
multi-GPU machine is measured? One process runs exactly what rank 0 of each layout runs in one CFG
step (pipelines.denoise.predict_noise: its token shard through the linear layers, its head shard
through attention, the guidance combine), with every torch.distributed call replaced by a local
copy of the same shape (so the copies' memory traffic stays in the measurement, the link does not).
The replaced calls count the bytes this rank would send and receive, from the code's own shapes,
and the calls (Ulysses: one all-to-all for q, k, v and one for the output per layer).

    projected ms = per-rank ms + max(sent, received) bytes / bandwidth

with the link bandwidth an ASSUMPTION (--link-gbs, default 450 GB/s: H200 NVLink 4, 900 GB/s
bidirectional, i.e. 450 per direction; real all-to-all reaches less) until the multi-GPU issue
measures it. Communication is counted as not overlapped (Ulysses' all-to-alls are not; the ring's
transfers are issued before each block's attention, so its row is pessimistic).

Run from the repository root on a CUDA machine (fa3-fwd optional, see benchmarks/README.md):

    python3 benchmarks/parallel_step.py                 # Wan2.1-1.3B 480x832x81 and 14B 720x1280x81
    python3 benchmarks/parallel_step.py --model 1.3b    # one model
    python3 benchmarks/parallel_step.py --tiny          # CPU smoke run of the harness
    python3 benchmarks/parallel_step.py --model 14b --warmup 0 --iters 1   # ~2 min on an H100 (one
                                                        # step per row after one untimed 1-GPU step)

Random bf16 weights (norms, modulation tables and the time MLP in fp32, as loading keeps them),
text 512 tokens. Median of --iters steps after --warmup, CUDA events. The table is printed last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from wan_models import MODELS, random_dit  # noqa: E402

from mmgen.attention import select_attention  # noqa: E402
from mmgen.models.wan import WanConfig, WanDiT  # noqa: E402
from mmgen.parallel.layout import ParallelLayout  # noqa: E402
from pipelines.denoise import (  # noqa: E402
    Conditioning,
    DenoiseModels,
    DenoiseOptions,
    ResidentPlacement,
    TextBranch,
    plan_steps,
    predict_noise,
    split_branches,
)

# 8 heads: the tiny run exercises Ulysses degrees 2, 4 and 8 (wan_models.TINY has 2).
TINY = (
    WanConfig(
        num_attention_heads=8,
        attention_head_dim=16,
        in_channels=16,
        out_channels=16,
        text_dim=64,
        freq_dim=32,
        ffn_dim=256,
        num_layers=2,
        text_len=32,
    ),
    (64, 96, 9),
)
# (name, sp degree, ring degree, cfg parallel); rows whose Ulysses degree does not divide the heads are skipped
LAYOUTS = (
    ("1 GPU", 1, 1, False),
    ("cfg2", 1, 1, True),
    ("ulysses2", 2, 1, False),
    ("ring2", 2, 2, False),
    ("cfg2 x ulysses2", 2, 1, True),
    ("ulysses4", 4, 1, False),
    ("ulysses2 x ring2", 4, 2, False),
    ("cfg2 x ulysses4", 4, 1, True),
    ("cfg2 x ulysses2 x ring2", 4, 2, True),
    ("ulysses8", 8, 1, False),
    ("ulysses4 x ring2", 8, 2, False),
)
GUIDANCE = 5.0
OPTIONS = DenoiseOptions()  # both CFG branches as one batch-2 call (the default)


@dataclass
class Traffic:
    """Bytes this rank would send and receive, and its calls, by collective, filled by the local stand-ins."""

    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, sent: int, received: int) -> None:
        self.sent[kind] = self.sent.get(kind, 0) + sent
        self.received[kind] = self.received.get(kind, 0) + received
        self.calls[kind] = self.calls.get(kind, 0) + 1

    @property
    def busiest(self) -> int:
        return max(sum(self.sent.values()), sum(self.received.values()))


class LocalGroup:
    """Stands in for a process group of `size` ranks (this process plays rank 0 of it)."""

    def __init__(self, size: int) -> None:
        self.size = size


@dataclass
class _Work:
    def wait(self) -> None:
        return None


def install_local_collectives(traffic: Traffic) -> Callable[[], None]:
    """Replace the torch.distributed calls mmgen.parallel makes by same-shape local copies; returns undo."""
    saved = {
        name: getattr(dist, name)
        for name in ("all_to_all_single", "all_gather", "batch_isend_irecv", "get_global_rank", "P2POp")
    }

    def all_to_all_single(output, inp, group=None):
        # ring/pairwise all-to-all: every rank keeps 1/n and sends the other (n-1)/n of its input
        moved = inp.numel() * inp.element_size() * (group.size - 1) // group.size
        traffic.add("all_to_all", moved, moved)
        output.copy_(inp)

    def all_gather(parts, inp, group=None):
        size = inp.numel() * inp.element_size()
        traffic.add("all_gather", size * (len(parts) - 1), size * (len(parts) - 1))
        for part in parts:
            part.copy_(inp)

    class P2POp:
        def __init__(self, op, tensor, peer, group=None):
            self.op, self.tensor = op, tensor

    def batch_isend_irecv(ops):
        sends = [op.tensor for op in ops if op.op is dist.isend]
        receives = [op.tensor for op in ops if op.op is dist.irecv]
        for send, receive in zip(sends, receives, strict=True):
            size = send.numel() * send.element_size()
            traffic.add("ring p2p", size, size)
            receive.copy_(send)
        return [_Work()]

    dist.all_to_all_single = all_to_all_single
    dist.all_gather = all_gather
    dist.batch_isend_irecv = batch_isend_irecv
    dist.get_global_rank = lambda group, rank: rank
    dist.P2POp = P2POp

    def undo() -> None:
        for name, value in saved.items():
            setattr(dist, name, value)

    return undo


def rank0_layout(sp: int, ring: int, cfg: bool, device: torch.device) -> ParallelLayout:
    """Rank 0 of a world of sp x (2 if cfg) ranks, its groups local stand-ins."""
    cfg_degree = 2 if cfg else 1
    return ParallelLayout(
        world_size=sp * cfg_degree,
        rank=0,
        device=device,
        sp_degree=sp,
        sp_group=LocalGroup(sp),
        cfg_degree=cfg_degree,
        cfg_group=LocalGroup(cfg_degree),
        ring_degree=ring,
        ring_group=LocalGroup(ring),
        ulysses_group=LocalGroup(sp // ring),
    )


def make_step(
    model: WanDiT, video: tuple[int, int, int], device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, Conditioning]:
    height, width, frames = video
    config = model.config
    latents = torch.randn(
        1, config.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8, device=device
    )
    text = torch.randn(2, config.text_len, config.text_dim, device=device, dtype=dtype)
    metadata = WanDiT.build_attention_metadata()
    both = TextBranch(text, metadata)
    return latents, Conditioning(both, split_branches(both, lambda row: metadata))


def timed(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median ms of iters calls after warmup calls (CUDA events on a GPU, perf_counter on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            tick = time.perf_counter()
            fn()
            times.append((time.perf_counter() - tick) * 1e3)
    return statistics.median(times)


def measure(
    call: Callable[[], object], device: torch.device, warmup: int, iters: int
) -> tuple[float, Traffic]:
    """(median ms of rank 0's step, the bytes one step sends and receives) with local stand-ins for the collectives.

    The first call counts the bytes and is the first warmup call; with warmup 0 it is also the
    first timed one (one call per row: how the 14B rows fit a short device session).
    """
    traffic = Traffic()
    undo = install_local_collectives(traffic)
    try:
        with torch.no_grad():
            first = timed(call, device, 0, 1)
            per_step = Traffic(dict(traffic.sent), dict(traffic.received), dict(traffic.calls))
            if warmup == 0:
                samples = [first, *(timed(call, device, 0, 1) for _ in range(iters - 1))]
                return statistics.median(samples), per_step
            return timed(call, device, warmup - 1, iters), per_step
    finally:
        undo()


def run_model(
    name: str, config: WanConfig, video: tuple[int, int, int], args: argparse.Namespace
) -> list[str]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_dit(config, device, dtype)
    attention = select_attention(args.backend, device=device, dtype=dtype, head_dim=config.attention_head_dim)
    latents, conditioning = make_step(model, video, device, dtype)
    step = plan_steps(torch.tensor([900.0]), (GUIDANCE,))[0]
    tokens = latents[0, 0].numel() // 4
    rows, base = [], None
    if args.warmup == 0:
        # One untimed 1-GPU step first, so the first row does not carry the process's first-use costs
        # (allocator growth, kernel and cuBLAS set-up) that the later rows do not pay.
        single = DenoiseModels((model,), attention, ParallelLayout.single(), ResidentPlacement(), dtype)
        with torch.no_grad():
            predict_noise(latents, step, conditioning, single, OPTIONS)
    for layout_name, sp, ring, cfg in LAYOUTS:
        gpus = sp * (2 if cfg else 1)
        if gpus > args.max_gpus:
            continue
        if (
            ring > 1
            and device.type == "cuda"
            and not getattr(getattr(attention, "kernel", None), "on_gpu", False)
        ):
            rows.append(
                f"{name:5} {layout_name:24} {gpus:4}  skipped: the ring needs a flash:* backend with an LSE"
            )
            continue
        if config.num_attention_heads % (sp // ring):
            rows.append(
                f"{name:5} {layout_name:24} {gpus:4}  skipped: {config.num_attention_heads} heads / ulysses {sp // ring}"
            )
            continue
        layout = ParallelLayout.single() if gpus == 1 else rank0_layout(sp, ring, cfg, device)
        models = DenoiseModels((model,), attention, layout, ResidentPlacement(), dtype)
        try:
            ms, per_step = measure(
                lambda models=models: predict_noise(latents, step, conditioning, models, OPTIONS),
                device,
                args.warmup,
                args.iters,
            )
        except Exception as err:  # noqa: BLE001 - one row fails (a kernel's keyword, memory), the table goes on
            rows.append(
                f"{name:5} {layout_name:24} {gpus:4}  failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
            )
            print(rows[-1], flush=True)
            continue
        link_ms = per_step.busiest / (args.link_gbs * 1e9) * 1e3
        projected = ms + link_ms
        base = projected if base is None else base
        kinds = (
            ", ".join(f"{k} {v / 2**20:.1f} ({per_step.calls[k]}x)" for k, v in sorted(per_step.sent.items()))
            or "-"
        )
        rows.append(
            f"{name:5} {layout_name:24} {gpus:4} {tokens:7} {ms:10.1f} {per_step.busiest / 2**20:10.1f} "
            f"{link_ms:8.1f} {projected:10.1f} {base / projected:6.2f}  {kinds}"
        )
        print(rows[-1], flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=(*MODELS, "all"), default="all")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny config, fp32)")
    parser.add_argument("--backend", default="auto", help="attention backend (mmgen.attention names)")
    parser.add_argument("--link-gbs", type=float, default=450.0, help="ASSUMED link GB/s per direction")
    parser.add_argument("--max-gpus", type=int, default=8)
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed calls per row (the byte-counting call is the first)"
    )
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    args.device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    return args


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    chosen = (
        {"tiny": TINY} if args.tiny else MODELS if args.model == "all" else {args.model: MODELS[args.model]}
    )
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for name, (config, video) in chosen.items():
        rows += run_model(name, config, video, args)
    print(
        f"\nper-rank work of one CFG step (rank 0), bytes from the code's shapes, link {args.link_gbs:.0f} GB/s ASSUMED"
    )
    print(
        f"{'model':5} {'layout':24} {'gpus':>4} {'tokens':>7} {'rank ms':>10} {'MiB/rank':>10} "
        f"{'link ms':>8} {'proj. ms':>10} {'x 1GPU':>6}  MiB sent by kind (calls)"
    )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
