"""Do the row kernels run as fast with per-token modulation (a table + index, Wan2.2 TI2V) as per sample?

Run from the repository root on a CUDA machine (no bundles needed):

    python3 benchmarks/token_rows.py            # ~15 s on an H100 (mostly Triton JIT), estimate
    python3 benchmarks/token_rows.py --tiny     # CPU dry run (torch path only: the kernels need CUDA)

At TI2V-5B's step shape ([2, 27280, 3072] bf16, one CFG step) each row pass of a block runs in three
forms: the Triton kernel with one vector per sample ([B, 1, D]), the Triton kernel with per-token
vectors (a [2, 1, D] table of the distinct timesteps, the conditioning frame's 880 tokens of each
sample on row 0, the rest on row 1), and the torch path of that per-token form. Printed: ms (median
of --iters after --warmup calls) and the effective HBM rate of the activations each pass must move
(the vectors excluded); a per-token kernel near its per-sample row means the gather from the small
table costs nothing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from bench_utils import bench_device, environment_header, median_ms, print_table  # noqa: E402

from mmgen.layers.fused_norms import add_residual, layer_norm_modulate, residual_layer_norm  # noqa: E402
from mmgen.layers.modulation import modulation_vectors  # noqa: E402

SHAPE = (2, 27280, 3072)  # TI2V-5B, 704x1280x121: latents [31, 44, 80] / patch (1, 2, 2), batch 2 (CFG)
FRAME_TOKENS = 880  # 22 x 40 tokens per latent frame
TINY_SHAPE, TINY_FRAME = (2, 40, 96), 8


def passes(x, update, vectors, token_rows, kernel: bool) -> dict[str, tuple[Callable[[], object], int]]:
    """The block's row passes: name -> (call, activation tensors it reads + writes)."""
    shift, scale, gate, *_ = vectors
    eps = 1e-6
    return {
        "layer_norm_modulate": (
            lambda: layer_norm_modulate(
                x, eps=eps, shift=shift, scale=scale, kernel=kernel, token_rows=token_rows
            ),
            2,
        ),
        "residual_layer_norm (gated)": (
            lambda: residual_layer_norm(
                x, update, gate, eps=eps, shift=shift, scale=scale, kernel=kernel, token_rows=token_rows
            ),
            4,
        ),
        "add_residual (gated)": (
            lambda: add_residual(x, update, gate, kernel=kernel, token_rows=token_rows),
            3,
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="tiny shape on the CPU (dry run)")
    args = parser.parse_args()
    device = bench_device(args.tiny)
    shape, frame = (TINY_SHAPE, TINY_FRAME) if device.type != "cuda" else (SHAPE, FRAME_TOKENS)
    batch, tokens, dim = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(device, torch.bfloat16)
    update = torch.randn(shape, generator=gen).to(device, torch.bfloat16)
    table = torch.randn(1, 6, dim, generator=gen).to(device)
    per_sample = modulation_vectors(table, torch.randn(batch, 6, dim, generator=gen).to(device), 6)
    per_token = modulation_vectors(table, torch.randn(2, 6, dim, generator=gen).to(device), 6)
    token_rows = torch.ones(batch, tokens, dtype=torch.int32, device=device)
    token_rows[:, :frame] = 0
    forms = [
        ("kernel, per sample", per_sample, None, True),
        ("kernel, per token", per_token, token_rows, True),
    ]
    forms.append(("torch, per token", per_token, token_rows, False))
    rows = []
    activation_bytes = x.numel() * x.element_size()
    try:
        for label, vectors, index, kernel in forms:
            if kernel and device.type != "cuda":
                continue
            for name, (call, tensors) in passes(x, update, vectors, index, kernel).items():
                ms = median_ms(call, device, warmup=args.warmup, iters=args.iters)
                rows.append((name, label, f"{ms:.3f}", f"{tensors * activation_bytes / ms / 1e6:.0f}"))
                print(f"  {name} {label}: {ms:.3f} ms", flush=True)
    except KeyboardInterrupt:
        print("INTERRUPTED: the rows below were measured before the time limit", flush=True)
    print("\n" + environment_header(device))
    print(f"shape {list(shape)} bf16, vectors float32; per-token: rows 0 (first {frame} tokens) and 1")
    print_table([("pass", 28), ("form", 20), ("ms", 9), ("GB/s", 7)], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
