"""FP8 linear layers (issue 20): every Wan linear shape in bf16 vs FP8, quantization included as it runs.

Run from the repository root on an Ada/Hopper GPU:

    python3 benchmarks/fp8_linear.py                       # Wan2.1-1.3B 480x832x81 and 14B 720x1280x81
    python3 benchmarks/fp8_linear.py --models 1.3b
    python3 benchmarks/fp8_linear.py --tiny                # CPU smoke run (emulated FP8, torch norms)

One CFG step's shapes (batch 2: M = 2 x tokens rows; the text k/v 2 x 512 rows), random bf16
inputs and weights (weights ~ N(0, 1/K)). Each layer kind is timed with the op that produces its
input, because that is where FP8 costs or saves:
  self_qkv  bf16: LayerNorm+modulation kernel -> GEMM     fp8: the same kernel writing fp8 + row scales -> _scaled_mm
  cross_q   bf16: residual+LayerNorm kernel -> GEMM       fp8: the same kernel, fp8 out -> _scaled_mm
  cross_kv  bf16: GEMM on the text                        fp8: Triton row quantize -> _scaled_mm
  attn_out  bf16: GEMM on the attention output            fp8: Triton row quantize -> _scaled_mm   (x2 per block)
  FFN       four combinations of (ffn_in, ffn_out) in bf16 / fp8, each from the residual+LayerNorm+
            modulation kernel to the down-projection's output: bf16 up-projection = GEMM with the
            GELU in its cuBLASLt epilogue; fp8 up-projection = _scaled_mm, then the GELU runs in the
            down-projection's quantize pass (fp8 down) or as a torch GELU (bf16 down).
Columns: ms of each path (median of --iters CUDA-event timings), speed-up, the bare GEMM speed-up
(_scaled_mm vs bf16 GEMM, inputs already quantized; gemm_fa: the same with use_fast_accum), the relative L2 error of each path's output
against float32 on the same inputs (first 2,048 rows), and ms saved per CFG step (x layers x uses).
Last: the keep-list, the kinds where FP8 is faster by more than --margin (FFN: the best combination),
to copy into mmgen.layers.fp8_linear.FP8_LAYERS_BY_WIDTH (one entry per measured model width).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_utils import (  # noqa: E402
    bench_device,
    device_name,
    environment_header,
    print_table,
    relative_error,
    timed,
    versions,
    write_json,
)
from wan_models import MODELS, TINY, TINY_VIDEO  # noqa: E402

from mmgen.layers.fp8_linear import fp8_linear, quantize_rows, quantize_weight  # noqa: E402
from mmgen.layers.fused_norms import layer_norm_modulate, residual_layer_norm  # noqa: E402

CHECK_ROWS = 2048  # rows compared against float32


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="1.3b,14b", help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per path")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per path")
    parser.add_argument("--margin", type=float, default=1.02, help="keep FP8 where speed-up exceeds this")
    parser.add_argument("--json", type=Path, help="also write every number to this JSON file")
    return parser.parse_args()


def tokens_of(video: tuple[int, int, int], patch: tuple[int, int, int]) -> int:
    height, width, frames = video
    return ((frames - 1) // 4 + 1) // patch[0] * (height // 8 // patch[1]) * (width // 8 // patch[2])


class Bench:
    def __init__(self, device: torch.device, args: argparse.Namespace) -> None:
        self.device, self.args = device, args
        self.gen = torch.Generator(device=device).manual_seed(0)

    def randn(self, *shape: int, scale: float = 1.0, dtype=torch.bfloat16) -> torch.Tensor:
        return (torch.randn(shape, device=self.device, generator=self.gen) * scale).to(dtype)

    def linear(self, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.randn(n, k, scale=k**-0.5), self.randn(n, scale=0.1)

    def ms(self, fn: Callable[[], object]) -> float:
        _, _, times = timed(fn, self.device, warmup=self.args.warmup, iters=self.args.iters)
        return statistics.median(times)


def check(out: torch.Tensor, exact: torch.Tensor) -> float:
    return relative_error(out[..., :CHECK_ROWS, :].float(), exact)


def exact_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, gelu: bool = False
) -> torch.Tensor:
    """float32 reference on the first CHECK_ROWS rows (x [M, K])."""
    out = x[:CHECK_ROWS].float() @ weight.float().t() + bias.float()
    return F.gelu(out, approximate="tanh") if gelu else out


def model_rows(name: str, config, video, bench: Bench) -> list[dict]:
    dim, ffn, layers = config.dim, config.ffn_dim, config.num_layers
    tokens = 2 * tokens_of(video, config.patch_size)  # batch 2: one CFG step
    text_rows = 2 * config.text_len
    b = bench
    x = b.randn(1, tokens, dim)
    update = b.randn(1, tokens, dim)
    gate = b.randn(1, 1, dim, scale=0.1, dtype=torch.float32)
    shift = b.randn(1, 1, dim, scale=0.1, dtype=torch.float32)
    scale = b.randn(1, 1, dim, scale=0.1, dtype=torch.float32)
    norm_w = b.randn(dim, scale=0.1, dtype=torch.float32) + 1
    norm_b = b.randn(dim, scale=0.1, dtype=torch.float32)
    rows = []

    def row(kind, m, k, n, uses, bf16_ms, fp8_ms, gemm_speedup, err_bf16, err_fp8):
        rows.append(
            {
                "model": name,
                "kind": kind,
                "M": m,
                "K": k,
                "N": n,
                "bf16_ms": bf16_ms,
                "fp8_ms": fp8_ms,
                "speedup": bf16_ms / fp8_ms,
                "gemm_speedup": None if gemm_speedup is None else gemm_speedup[0],
                "gemm_speedup_fast_accum": None if gemm_speedup is None else gemm_speedup[1],
                "rel_err_bf16": err_bf16,
                "rel_err_fp8": err_fp8,
                "saved_ms_per_step": (bf16_ms - fp8_ms) * uses * layers,
            }
        )

    def gemm_speedup(act, weight, bias) -> tuple[float, float | None]:
        """Bare GEMMs: bf16 on the dequantized input vs _scaled_mm on the quantized one, without and with
        use_fast_accum (cuBLASLt/CUTLASS fast accumulation; mmgen's fp8_linear does not use it)."""
        q = quantize_weight(weight)
        dense = act.dequantize(torch.bfloat16)
        bf16 = b.ms(lambda: F.linear(dense, weight, bias))
        plain = bf16 / b.ms(lambda: fp8_linear(act, q, bias, torch.bfloat16))
        if not dense.is_cuda:
            return plain, None
        values, scales = act.values.reshape(-1, act.values.shape[-1]), act.scales.reshape(-1, 1)

        def fast():
            return torch._scaled_mm(
                values, q.values.t(), scale_a=scales, scale_b=q.scales.view(1, -1), bias=bias,
                out_dtype=torch.bfloat16, use_fast_accum=True,
            )  # fmt: skip

        return plain, bf16 / b.ms(fast)

    # self_qkv: LayerNorm + modulation -> q/k/v stacked
    w, bias = b.linear(dim, 3 * dim)
    qw = quantize_weight(w)

    def qkv_bf16():
        return F.linear(layer_norm_modulate(x, eps=1e-6, shift=shift, scale=scale), w, bias)

    def qkv_fp8():
        return fp8_linear(
            layer_norm_modulate(x, eps=1e-6, shift=shift, scale=scale, fp8=True), qw, bias, torch.bfloat16
        )

    h = layer_norm_modulate(x, eps=1e-6, shift=shift, scale=scale)
    exact = exact_linear(h[0], w, bias)
    h8 = layer_norm_modulate(x, eps=1e-6, shift=shift, scale=scale, fp8=True)
    row(
        "self_qkv", tokens, dim, 3 * dim, 1, b.ms(qkv_bf16), b.ms(qkv_fp8), gemm_speedup(h8, w, bias),
        check(qkv_bf16()[0], exact), check(qkv_fp8()[0], exact),
    )  # fmt: skip

    # cross_q: residual + LayerNorm (affine) -> q
    w, bias = b.linear(dim, dim)
    qw = quantize_weight(w)

    def q_bf16():
        return F.linear(
            residual_layer_norm(x, update, gate, eps=1e-6, weight=norm_w, bias=norm_b)[1], w, bias
        )

    def q_fp8():
        h8 = residual_layer_norm(x, update, gate, eps=1e-6, weight=norm_w, bias=norm_b, fp8=True)[1]
        return fp8_linear(h8, qw, bias, torch.bfloat16)

    h = residual_layer_norm(x, update, gate, eps=1e-6, weight=norm_w, bias=norm_b)[1]
    exact = exact_linear(h[0], w, bias)
    h8 = residual_layer_norm(x, update, gate, eps=1e-6, weight=norm_w, bias=norm_b, fp8=True)[1]
    row(
        "cross_q", tokens, dim, dim, 1, b.ms(q_bf16), b.ms(q_fp8), gemm_speedup(h8, w, bias),
        check(q_bf16()[0], exact), check(q_fp8()[0], exact),
    )  # fmt: skip

    # cross_kv: text tokens -> k/v stacked
    text = b.randn(text_rows, dim)
    w, bias = b.linear(dim, 2 * dim)
    qw = quantize_weight(w)
    exact = exact_linear(text, w, bias)
    row(
        "cross_kv", text_rows, dim, 2 * dim, 1,
        b.ms(lambda: F.linear(text, w, bias)), b.ms(lambda: fp8_linear(quantize_rows(text), qw, bias, torch.bfloat16)),
        gemm_speedup(quantize_rows(text), w, bias),
        check(F.linear(text, w, bias), exact), check(fp8_linear(text, qw, bias, torch.bfloat16), exact),
    )  # fmt: skip

    # attn_out: attention output (no producer of ours) -> out projection; self and cross attention
    attended = b.randn(tokens, dim)
    w, bias = b.linear(dim, dim)
    qw = quantize_weight(w)
    exact = exact_linear(attended, w, bias)
    row(
        "attn_out", tokens, dim, dim, 2,
        b.ms(lambda: F.linear(attended, w, bias)),
        b.ms(lambda: fp8_linear(quantize_rows(attended), qw, bias, torch.bfloat16)),
        gemm_speedup(quantize_rows(attended), w, bias),
        check(F.linear(attended, w, bias), exact), check(fp8_linear(attended, qw, bias, torch.bfloat16), exact),
    )  # fmt: skip
    attended = text = None  # freed before the FFN rows

    # FFN: residual + LayerNorm + modulation -> up (GELU) -> down, four combinations
    w_in, b_in = b.linear(dim, ffn)
    w_out, b_out = b.linear(ffn, dim)
    q_in, q_out = quantize_weight(w_in), quantize_weight(w_out)

    def norm(fp8: bool):
        return residual_layer_norm(x, update, None, eps=1e-6, shift=shift, scale=scale, fp8=fp8)[1]

    def up_bf16(h):
        flat = h.reshape(-1, dim)
        if flat.is_cuda:
            return torch._addmm_activation(b_in, flat, w_in.t(), use_gelu=True)
        return F.gelu(F.linear(flat, w_in, b_in), approximate="tanh")

    def ffn_path(fp8_in: bool, fp8_out: bool) -> Callable[[], torch.Tensor]:
        def run():
            if fp8_in:
                pre = fp8_linear(norm(True), q_in, b_in, torch.bfloat16).reshape(-1, ffn)
                hidden = quantize_rows(pre, gelu=True) if fp8_out else F.gelu(pre, approximate="tanh")
            else:
                hidden = up_bf16(norm(False))
                hidden = quantize_rows(hidden) if fp8_out else hidden
            return (
                fp8_linear(hidden, q_out, b_out, torch.bfloat16)
                if fp8_out
                else F.linear(hidden, w_out, b_out)
            )

        return run

    h = norm(False)[0]
    exact = exact_linear(exact_linear(h, w_in, b_in, gelu=True), w_out, b_out)
    base_ms = None
    for fp8_in, fp8_out in ((False, False), (True, False), (False, True), (True, True)):
        fn = ffn_path(fp8_in, fp8_out)
        kind = (
            "ffn " + "+".join(k for k, on in (("in", fp8_in), ("out", fp8_out)) if on)
            if (fp8_in or fp8_out)
            else None
        )
        ms = b.ms(fn)
        err = check(fn(), exact)
        if kind is None:
            base_ms, base_err = ms, err
            continue
        row(kind, tokens, dim, ffn, 1, base_ms, ms, None, base_err, err)
    return rows


def keep_list(rows: list[dict], margin: float) -> list[str]:
    keep = [r["kind"] for r in rows if not r["kind"].startswith("ffn") and r["speedup"] > margin]
    ffn = [r for r in rows if r["kind"].startswith("ffn") and r["speedup"] > margin]
    if ffn:
        best = max(ffn, key=lambda r: r["speedup"])
        keep += ["ffn_" + part for part in best["kind"].split(" ")[1].split("+")]
    return keep


def main() -> None:
    args = parse_args()
    device = bench_device(args.tiny)
    bench = Bench(device, args)
    models = [("tiny", TINY, TINY_VIDEO)] if args.tiny else [(m, *MODELS[m]) for m in args.models.split(",")]
    rows: list[dict] = []
    keeps: dict[str, list[str]] = {}
    try:
        for name, config, video in models:
            measured = model_rows(name, config, video, bench)
            rows += measured
            keeps[name] = keep_list(measured, args.margin)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    except KeyboardInterrupt:
        print("interrupted: the rows measured so far")
    print("\n" + environment_header(device))
    print(
        "one CFG step's linear shapes, batch 2; ms = producer (norm / quantize) + GEMM, median of", args.iters
    )
    print_table(
        [
            ("model kind", 18),
            ("M", 7),
            ("K", 6),
            ("N", 6),
            ("bf16_ms", 8),
            ("fp8_ms", 8),
            ("speedup", 8),
            ("gemm_x", 7),
            ("gemm_fa", 7),
            ("err_bf16", 9),
            ("err_fp8", 9),
            ("saved/step", 10),
        ],
        [
            (
                f"{r['model']} {r['kind']}",
                r["M"],
                r["K"],
                r["N"],
                f"{r['bf16_ms']:.3f}",
                f"{r['fp8_ms']:.3f}",
                f"{r['speedup']:.2f}x",
                None if r["gemm_speedup"] is None else f"{r['gemm_speedup']:.2f}x",
                None if r["gemm_speedup_fast_accum"] is None else f"{r['gemm_speedup_fast_accum']:.2f}x",
                f"{r['rel_err_bf16']:.1e}",
                f"{r['rel_err_fp8']:.1e}",
                f"{r['saved_ms_per_step']:.1f}ms",
            )
            for r in rows
        ],
    )
    for name, keep in keeps.items():
        print(f"keep-list {name} (FP8 where > {args.margin}x): {sorted(keep)}")
    write_json(
        args.json, {"device": device_name(device), "versions": versions(), "rows": rows, "keep": keeps}
    )


if __name__ == "__main__":
    main()
