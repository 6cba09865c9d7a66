"""Which tile for the per-head RMSNorm + RoPE kernel (mmgen.layers.triton_norms.head_rms_norm_rope)?

Run on a CUDA machine from the repository root: `python3 benchmarks/head_norm_tile.py`. Times the
kernel on Qwen-Image's image q at 1328x1328 (batch 2 x 6,889 tokens x 24 heads x 128, bf16, rows
scattered into the joint rows) for each (rows, head_block, num_warps), against a plain copy of the
same bytes (the bandwidth bound), and prints them fastest first.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_utils import environment_header  # noqa: E402

from mmgen.layers import triton_norms  # noqa: E402
from mmgen.models.qwen_image_joint import JointLayout  # noqa: E402


def cuda_ms(fn, iters: int = 20) -> float:
    fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters


def main() -> None:
    device = torch.device("cuda")
    batch, tokens, heads, head_dim = 2, 6889, 24, 128
    layout = JointLayout.build([24, 12], tokens, text_width=24, device=device)
    x = torch.randn(batch, tokens, heads * head_dim, device=device, dtype=torch.bfloat16)
    weight = torch.ones(head_dim, device=device, dtype=torch.bfloat16)
    angles = torch.rand(tokens, head_dim, device=device)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    out = torch.empty(batch * (24 + tokens), heads * head_dim, device=device, dtype=torch.bfloat16)
    print(environment_header(device))
    copy_ms = cuda_ms(lambda: out[: batch * tokens].copy_(x.view(-1, heads * head_dim)))
    results = []
    for rows, head_block, warps in itertools.product((1, 2, 4, 8), (2, 4, 8, 32), (1, 2, 4, 8)):
        if rows * head_block * head_dim // 2 < 32 * warps or rows * head_block > 128:
            continue

        def call(rows=rows, head_block=head_block, warps=warps):
            triton_norms.head_rms_norm_rope(
                x,
                weight,
                1e-6,
                cos,
                sin,
                out,
                layout.image_index,
                rows=rows,
                head_block=head_block,
                num_warps=warps,
            )

        results.append((cuda_ms(call), rows, head_block, warps))
    print(f"copy of the same bytes: {copy_ms:.3f} ms")
    for ms, rows, head_block, warps in sorted(results)[:12]:
        print(
            f"rows {rows:2} head_block {head_block:2} warps {warps}: {ms:.3f} ms ({ms / copy_ms:.2f}x copy)"
        )
    default = [r for r in results if (r[1], r[2]) == (2, 32)]
    print("current default (rows 2, all heads):", ", ".join(f"{w} warps {ms:.3f}" for ms, _, _, w in default))


if __name__ == "__main__":
    main()
