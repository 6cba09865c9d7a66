"""Can a Qwen-Image-2.1 cached step under Ulysses be ONE CUDA graph, its NCCL all-to-alls inside, and
what do the seams of the piecewise capture cost? (issue 36: SGLang's 2.91 s on two H100s)

mmgen replays a cached step as graphs cut at the collectives (mmgen.models.step_graph): 65 pieces a
step at 32 layers, each all-to-all run eagerly between them. sglang#31852 reports that a NCCL collective
captured through torch's process group hangs at replay (both ranks). This script asks it directly on
two GPUs (spawned ranks, NCCL): per rank the release-config transformer (7.12 B, random bf16 weights,
the same seed on both ranks), a 1024x1024 text-to-image layout with a 200-token prompt, the prefill,
then three ways of running the same cached step, --steps times each:

    eager    every call eager
    pieces   StepGraph.capture (seams at the collectives), replayed
    whole    StepGraph.capture(seams=False) on a group of its own (fresh communicators), replayed
    shared   the same on the eager calls' group (eager collectives on those communicators between replays)

After each way's replays an eager call and a replay run again on the same communicators (a pipeline runs
a request's prefill eagerly between two requests' replays): both must still give the eager bits.

Rank 0 prints ms per step (CUDA events, median) and whether each way's output has the eager call's bits,
as each finishes (so a hang in `whole` leaves the others printed); the ranks are killed after
--timeout-s. Run on a 2-GPU host:

    python3 benchmarks/step_graph_collectives.py [--steps 20] [--timeout-s 150]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the checkout, and what qwen_image21_step imports

import torch  # noqa: E402
from bench_utils import timed  # noqa: E402
from qwen_image21_step import fill_random  # noqa: E402

from mmgen.attention import select_attention  # noqa: E402
from mmgen.models.qwen_image21 import PrefixCache, QwenImage21Config, QwenImage21Transformer  # noqa: E402
from mmgen.models.qwen_image21_layout import BlockCausalLayout  # noqa: E402
from mmgen.models.step_graph import StepGraph  # noqa: E402
from mmgen.parallel.collective import run_now  # noqa: E402
from mmgen.parallel.launch import run_parallel  # noqa: E402
from mmgen.parallel.layout import ParallelConfig, ParallelLayout, init_layout  # noqa: E402

TEXT_TOKENS, SIDE = 200, 1024


def random_model(device: torch.device) -> QwenImage21Transformer:
    """The release config with seeded random bf16 weights (the same on every rank)."""
    with torch.device("meta"):
        model = QwenImage21Transformer(QwenImage21Config())
    model = model.to(torch.bfloat16).to_empty(device=device)
    fill_random(model, device)
    return model.eval().requires_grad_(False)


def median_ms(run, steps: int) -> tuple[float, torch.Tensor]:
    """Median ms of `steps` calls of run() after one (CUDA events) and the last output."""
    out, _, times = timed(run, torch.device("cuda"), warmup=1, iters=steps)
    return statistics.median(times), out


def rank(layout: ParallelLayout, steps: int) -> dict:
    device = layout.device
    model = random_model(device)
    attention = select_attention(
        "auto", device=device, dtype=torch.bfloat16, head_dim=model.config.attention_head_dim
    )
    grid = (1, SIDE // 16, SIDE // 16)
    blocks = BlockCausalLayout.build([TEXT_TOKENS], [grid], text_width=TEXT_TOKENS, device=device)
    g = torch.Generator(device).manual_seed(1)
    text = torch.randn(1, TEXT_TOKENS, model.config.context_in_dim, generator=g, device=device).to(
        torch.bfloat16
    )
    latents = torch.randn(1, blocks.latent_tokens, model.config.in_channels, generator=g, device=device)
    latents = latents.to(torch.bfloat16)
    timestep = torch.full((1,), 0.5, device=device)
    results = {}

    def say(line: str) -> None:
        if layout.rank == 0:
            print(line, flush=True)

    def cached_call(parallel: ParallelLayout):
        cache = PrefixCache()
        with torch.no_grad():
            model(latents, torch.ones(1, device=device), text, attention=attention, metadata=blocks,
                  cache=cache, parallel=parallel)  # fmt: skip

        def call(x, t, collective):
            return model(x, t, None, attention=attention, metadata=blocks, cache=cache, parallel=parallel,
                         collective=collective)  # fmt: skip

        return call

    target = latents[:, -blocks.target_tokens :]
    with torch.no_grad():
        eager = cached_call(layout)
        ms, expected = median_ms(lambda: eager(target, timestep, collective=run_now), steps)
        results["eager"] = {"ms": ms, "same_bits": True}
        say(f"eager   {ms:7.1f} ms/step")
        for way in ("pieces", "whole", "shared"):
            # whole: a group of its own; shared: the eager calls' group (its communicators run eager
            # collectives between the replays, as a pipeline's prefill and CFG exchanges would)
            parallel = init_layout(ParallelConfig(sp=layout.world_size), device) if way == "whole" else layout
            fn = cached_call(parallel)
            fn(target, timestep, collective=run_now)  # warm-up
            torch.cuda.synchronize()
            tick = time.perf_counter()
            graph = StepGraph.capture(fn, target, timestep, seams=way == "pieces")
            graph(target, timestep)  # the first replay uploads the graphs: part of what a request pays
            torch.cuda.synchronize()
            captured_s = time.perf_counter() - tick
            say(
                f"{way:7s} captured: {len(graph.pieces)} graph(s), capture + first replay {captured_s * 1e3:.0f} ms"
            )
            ms, got = median_ms(lambda g=graph: g(target, timestep), steps)
            same = bool(torch.equal(got, expected))
            # eager calls on the same communicators after the replays, then replays again
            again = fn(target, timestep, collective=run_now)
            replayed = graph(target, timestep)
            torch.cuda.synchronize()
            after = bool(torch.equal(again, expected) and torch.equal(replayed, expected))
            results[way] = {
                "ms": ms,
                "same_bits": same,
                "after_eager": after,
                "graphs": len(graph.pieces),
                "capture_s": captured_s,
            }
            say(
                f"{way:7s} {ms:7.1f} ms/step, {'the same' if same else 'OTHER'} bits as eager;"
                f" eager then replay again: {'the same' if after else 'OTHER'} bits"
            )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout-s", type=float, default=150.0)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 CUDA GPUs")
    results = run_parallel(
        rank, ParallelConfig(sp=2), args.steps, device_type="cuda", timeout_s=args.timeout_s
    )
    print(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
