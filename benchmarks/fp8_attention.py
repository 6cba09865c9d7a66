"""FP8 attention (issue 20 item 4): FA3 (fa3-fwd 0.0.3) e4m3 forward vs its bf16 forward at Wan shapes.

Run from the repository root on a Hopper GPU with the fa3fwd bundle unpacked (GPU.md):

    python3 benchmarks/fp8_attention.py                   # 1.3B 480p and 14B 720p self-attention, batch 2
    python3 benchmarks/fp8_attention.py --tiny            # CPU smoke run: only the quantization and error math

fa3-fwd 0.0.3 is built with FP8 (FLASHATTENTION_DISABLE_FP8 False; sm90 float_e4m3 kernels for head
dims 64-256): `flash_attn_func(q8, k8, v8, q_descale=, k_descale=, v_descale=)` with float8_e4m3fn
q/k/v, descales float32 [B, H_kv], bf16 output. This script answers whether that pays at Wan shapes
before an `fp8_attention` option is built: per shape, the bf16 kernel's ms, the FP8 kernel's ms, the
quantization's ms as it runs (mmgen.attention.fp8.quantize_heads: an amax reduction and a Triton
scaled cast per tensor, for q, k and v; a fused producer could make q/k nearly free: after RMSNorm
their bound is static), and the relative L2 error
of each output against float32 attention on the first --check queries. Random unit-variance q/k/v:
trained Wan q/k have outlier channels, so the error here is a lower bound.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from bench_utils import (  # noqa: E402
    bench_device,
    device_name,
    environment_header,
    one_line,
    print_table,
    relative_error,
    timed,
    versions,
    write_json,
)

from mmgen.attention.fp8 import quantize_heads  # noqa: E402

# (label, batch, tokens, heads, head_dim): one CFG step's self-attention.
SHAPES = {
    "1.3b": ("1.3B 480p", 2, 32760, 12, 128),
    "14b": ("14B 720p", 2, 75600, 40, 128),
}
TINY_SHAPE = ("tiny", 2, 256, 2, 64)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="1.3b,14b", help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--tiny", action="store_true", help="tiny shape, CPU: quantization and error only")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--check", type=int, default=256, help="queries compared against float32")
    parser.add_argument("--json", type=Path, help="also write every number to this JSON file")
    return parser.parse_args()


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, queries: int) -> torch.Tensor:
    """float32 attention of the first `queries` queries -> [B, queries, H, D]."""
    q, k, v = (t.float().transpose(1, 2) for t in (q[:, :queries], k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2)


def measure(shape: tuple, args: argparse.Namespace, device: torch.device, kernel) -> dict:
    """One shape's row: kernel ms (bf16, fp8), quantize ms as it runs, errors against float32."""
    label, batch, tokens, heads, head_dim = shape

    def ms(fn) -> float:
        return statistics.median(timed(fn, device, warmup=args.warmup, iters=args.iters)[2])

    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(batch, tokens, heads, head_dim, device=device, generator=gen).to(torch.bfloat16)
        for _ in range(3)
    )
    quantize_ms = ms(lambda: [quantize_heads(t) for t in (q, k, v)])
    (q8, qd), (k8, kd), (v8, vd) = (quantize_heads(t) for t in (q, k, v))
    exact = reference(q, k, v, args.check)
    bf16_ms = fp8_ms = None
    failure = None
    if kernel is not None:
        bf16_ms = ms(lambda: kernel(q, k, v))
        out_bf16 = kernel(q, k, v)
        try:
            fp8_ms = ms(lambda: kernel(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd))
            out_fp8 = kernel(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
        except (RuntimeError, TypeError, ValueError) as err:  # report it as the row's answer
            failure = one_line(err)
            print(f"{label}: FP8 forward failed: {failure}")
            out_fp8 = torch.full_like(out_bf16, float("nan"))
    else:  # CPU: the same math on dequantized operands, no kernel times
        out_bf16 = reference(q, k, v, args.check)
        deq = [t.float() * d[:, None, :, None] for t, d in ((q8, qd), (k8, kd), (v8, vd))]
        out_fp8 = reference(*deq, args.check)
    flops = 4 * batch * heads * tokens * tokens * head_dim
    return {
        "shape": label,
        "q": [batch, tokens, heads, head_dim],
        "bf16_ms": bf16_ms,
        "fp8_ms": fp8_ms,
        "quantize_ms": quantize_ms,
        "kernel_speedup": None if fp8_ms is None else bf16_ms / fp8_ms,
        "with_quantize_speedup": None if fp8_ms is None else bf16_ms / (fp8_ms + quantize_ms),
        "fp8_tflops": None if fp8_ms is None else flops / fp8_ms / 1e9,
        "rel_err_bf16": relative_error(out_bf16[:, : args.check].float(), exact),
        "rel_err_fp8": relative_error(out_fp8[:, : args.check].float(), exact),
        "fp8_failure": failure,
    }


def main() -> None:
    args = parse_args()
    device = bench_device(args.tiny)
    kernel = None
    if device.type == "cuda":
        import fa3_fwd_interface

        kernel = fa3_fwd_interface.flash_attn_func
    shapes = [TINY_SHAPE] if args.tiny else [SHAPES[m] for m in args.models.split(",")]
    rows, results = [], []
    try:
        for shape in shapes:
            row = measure(shape, args, device, kernel)
            results.append(row)

            def fmt(value, spec):
                return None if value is None else format(value, spec)

            rows.append(
                (
                    row["shape"],
                    fmt(row["bf16_ms"], ".2f"),
                    fmt(row["fp8_ms"], ".2f"),
                    f"{row['quantize_ms']:.2f}",
                    fmt(row["kernel_speedup"], ".2f"),
                    fmt(row["with_quantize_speedup"], ".2f"),
                    fmt(row["fp8_tflops"], ".0f"),
                    f"{row['rel_err_bf16']:.1e}",
                    f"{row['rel_err_fp8']:.1e}",
                )
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()
    except KeyboardInterrupt:
        print("interrupted: the rows measured so far")
    print("\n" + environment_header(device))
    print("self-attention of one CFG step (batch 2), FA3 bf16 vs FA3 e4m3 with per-(batch, head) descales")
    print_table(
        [
            ("shape", 10),
            ("bf16_ms", 8),
            ("fp8_ms", 8),
            ("quant_ms", 9),
            ("kernel_x", 9),
            ("w/quant_x", 9),
            ("fp8_TF/s", 9),
            ("err_bf16", 9),
            ("err_fp8", 9),
        ],
        rows,
    )
    write_json(args.json, {"device": device_name(device), "versions": versions(), "rows": results})


if __name__ == "__main__":
    main()
