"""Which parallel layouts give the same bits as one process? (CPU, gloo; RESULTS.md section 8a.)

Runs the embedded default model (fp32, `auto` attention = SDPA on the CPU, 3 steps, seed 0) once in
this process and once per layout on a forked gloo world, at a token count the degrees divide and
one they do not (padded), and prints the frames sha256 and the max abs difference of the final
latents from the one-process run:

    python3 benchmarks/parallel_equivalence.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from mmgen.default_model import ensure_default_model  # noqa: E402
from mmgen.parallel.launch import run_parallel  # noqa: E402
from mmgen.parallel.layout import ParallelConfig, ParallelLayout  # noqa: E402
from pipelines.wan_t2v import WanT2VPipeline  # noqa: E402

SIZES = {"72 tokens": (64, 96, 9), "45 tokens": (48, 80, 9)}
LAYOUTS = {
    "ulysses2": ParallelConfig(sp=2),
    "ring2": ParallelConfig(sp=2, ring=2),
    "cfg2": ParallelConfig(cfg=True),
    "cfg2 x ulysses2": ParallelConfig(sp=2, cfg=True),
    "ulysses2 x ring2": ParallelConfig(sp=4, ring=2),
    "ring4": ParallelConfig(sp=4, ring=4),
}


def generate(layout: ParallelLayout | None, directory: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """{size: (frames sha256, final latents)} for every size, on this rank's layout."""
    pipe = WanT2VPipeline.from_pretrained(directory, parallel=layout)
    results = {}
    for name, (height, width, frames) in SIZES.items():
        result = pipe(
            "a red fox",
            height=height,
            width=width,
            num_frames=frames,
            num_inference_steps=3,
            seed=0,
            progress=False,
        )
        results[name] = (result.frames_sha256, result.latents)
    return results


def main() -> None:
    torch.set_num_threads(1)
    directory = ensure_default_model()
    single = generate(None, directory)
    rows = [("1 process", single)]
    for name, config in LAYOUTS.items():
        rows.append((name, run_parallel(generate, config, directory, start_method="fork")))
    print(
        f"torch {torch.__version__}, gloo, default model fp32; sha (first 12) / bitwise vs 1 process / max abs latents"
    )
    print(f"{'layout':18} " + " ".join(f"{size:>38}" for size in SIZES))
    for name, results in rows:
        cells = []
        for size in SIZES:
            sha, latents = results[size]
            same = "same" if sha == single[size][0] else "differs"
            cells.append(f"{sha[:12]} {same:>7} {(latents - single[size][1]).abs().max().item():9.1e}")
        print(f"{name:18} " + " ".join(f"{cell:>38}" for cell in cells))


if __name__ == "__main__":
    main()
