"""Decode-step time of the LLM attention backends over a paged KV cache, against the KV-read floor.

A step = the attention of one decoder step of an encoder-decoder model: metadata for the batch, then
for each decoder layer its self-attention (sliding-window layers alternating with global ones) and
its cross-attention over each request's own encoder tokens (projections and MLPs left out: this is
the part the backends differ in). Default shapes follow T5Gemma-2B's decoder attention (8 query / 4
KV heads of 256, window 4096), 4 decoder layers, page size 16, bf16, encoder lengths near 256.

Rows: backend (torch_native only for small cases), flash_attention (scheduler metadata once per batch),
flashinfer; each eager (metadata + every layer launched from Python) and replayed from a CUDA graph
(CudaGraphRunner: replay metadata + one graph launch). Floor = K+V bytes the step must read (global
layers: the context; sliding layers: min(context, window); cross layers: the encoder tokens) at the
device-copy bandwidth measured here.

    python3 benchmarks/llm_decode.py [--batch-sizes 1,8,64] [--contexts 1024,8192] [--iters 30]
    python3 benchmarks/llm_decode.py --cpu-smoke     # tiny shapes on CPU through the references

Answered and removed (git history at commit ea73d1a; RESULTS.md 6): the per-layer scheduler-metadata
rows (FA4 needs none: the same time) and --host-only, the host work per step with stand-in providers
(tests/test_llm_host_overhead.py keeps its no-read-back claim).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from mmgen.errors import MmgenError  # noqa: E402
from mmgen.llm.attention_layer import AttentionLayer  # noqa: E402
from mmgen.llm.backends import make_backend  # noqa: E402
from mmgen.llm.cuda_graph_runner import CudaGraphRunner  # noqa: E402
from mmgen.llm.forward_batch import ForwardMode  # noqa: E402
from mmgen.llm.memory import KVPool, PageAllocator, ReqToTokenPool, RequestMemory  # noqa: E402
from mmgen.llm.speculative import build_batch  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (sliding, global, sliding, ...)")
    p.add_argument("--q-heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--encoder-len", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--backends", default="torch_native,flash_attention,flashinfer")
    p.add_argument(
        "--flashinfer-kernel-backend", default="auto", help='FlashInfer backend= ("auto", "fa2", "fa3")'
    )
    p.add_argument("--torch-native-max", default="8,1024", help="largest batch,context for torch_native")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU (checks the script runs)")
    return p.parse_args()


def attention_layers(args) -> list[AttentionLayer]:
    common = dict(
        num_q_heads=args.q_heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        scaling=args.head_dim**-0.5,
        logit_softcap=50.0,
    )
    layers = []
    for i in range(args.layers):
        window = args.window if i % 2 == 0 else None
        layers.append(AttentionLayer(layer_id=i, sliding_window=window, **common))
        layers.append(AttentionLayer(layer_id=i, is_cross_attention=True, **common))
    return layers


class AttentionStep(torch.nn.Module):
    """The attention of one decoder step as a 'model' the CudaGraphRunner can capture (static q/k/v)."""

    def __init__(self, layers: list[AttentionLayer], max_bs: int, device, dtype) -> None:
        super().__init__()
        h = layers[0]
        self.layers = layers
        self.q = torch.randn(max_bs, h.num_q_heads, h.head_dim, device=device, dtype=dtype)
        self.k = torch.randn(max_bs, h.num_kv_heads, h.head_dim, device=device, dtype=dtype)
        self.v = torch.randn(max_bs, h.num_kv_heads, h.head_dim, device=device, dtype=dtype)

    def decode(self, input_ids, positions, batch, backend) -> torch.Tensor:
        bs = input_ids.shape[0]
        out = torch.zeros_like(self.q[:bs])
        for layer in self.layers:
            if layer.is_cross_attention:
                out = out + backend.forward(self.q[:bs], None, None, layer, batch, save_kv_cache=False)
            else:
                out = out + backend.forward(self.q[:bs], self.k[:bs], self.v[:bs], layer, batch)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.flatten(1)


def encoder_lens(args, bs: int) -> list[int]:
    """Each request its own encoder length, near --encoder-len."""
    return [max(1, args.encoder_len - 3 * i % 29) for i in range(bs)]


def setup(args, bs: int, ctx: int, device, dtype, kv_shape: tuple[int, int] | None = None):
    """Pools with bs requests of ctx decoder tokens and their DECODE batch.

    kv_shape: (kv heads, head dim) of the KV pool when it should differ from the layers' (host-only runs
    read no K/V, so they keep the pool tiny)."""
    ps = args.page_size
    enc_lens = encoder_lens(args, bs)
    pages = sum(-(-e // ps) + -(-(ctx + 1) // ps) for e in enc_lens) + 2
    req_pool = ReqToTokenPool(bs + 1, max(enc_lens) + ctx + 2 * ps, device)
    memory = RequestMemory(req_pool, PageAllocator(pages, ps))
    allocs = [memory.allocate(e, ctx + 1) for e in enc_lens]
    heads, dim = kv_shape or (args.kv_heads, args.head_dim)
    kv_pool = KVPool(args.layers, pages, ps, heads, dim, dtype, device)
    batch = build_batch(
        ForwardMode.DECODE,
        req_pool.req_to_token,
        [a.row for a in allocs],
        enc_lens,
        [ctx - 1] * bs,
        [1] * bs,
    )
    return req_pool, kv_pool, batch, enc_lens


def kv_bytes(args, bs: int, ctx: int, enc_lens: list[int], dtype) -> int:
    per_token = 2 * args.kv_heads * args.head_dim * torch.finfo(dtype).bits // 8  # K and V
    tokens = 0
    for i in range(args.layers):
        tokens += bs * (min(ctx, args.window) if i % 2 == 0 else ctx)
        tokens += sum(enc_lens)
    return tokens * per_token


def copy_bandwidth(device) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of several 1 GiB copies."""
    if device.type != "cuda":
        n = 64 << 20
    else:
        n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(7):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n / statistics.median(times[2:])


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, iters: int, device) -> float:
    """Mean ms per step over iters back-to-back steps (host overhead included), after 3 warm-ups."""
    for _ in range(3):
        step()
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        step()
    sync(device)
    return (time.perf_counter() - t) * 1e3 / iters


def run_case(args, name: str, options: dict, graphs: bool, bs: int, ctx: int, device, dtype) -> float:
    req_pool, kv_pool, batch, _ = setup(args, bs, ctx, device, dtype)
    layers = attention_layers(args)
    backend = make_backend(name, req_pool, kv_pool, layers, **options)
    model = AttentionStep(layers, bs, device, dtype)
    ids = torch.zeros(bs, dtype=torch.int64, device=device)
    if graphs:
        runner = CudaGraphRunner(model, backend, batch_sizes=(bs,), use_cuda_graph=device.type == "cuda")
        runner.capture()

        def step():
            runner.replay(batch, ids)
    else:

        def step():
            backend.init_forward_metadata(batch)
            model.decode(ids, batch.positions, batch, backend)

    return time_steps(step, args.iters, device)


def main() -> int:
    args = parse_args()
    if args.cpu_smoke:
        device, dtype = torch.device("cpu"), torch.bfloat16
        args.batch_sizes, args.contexts, args.layers, args.iters = "1,3", "64", 2, 2
        args.head_dim, args.window, args.encoder_len, args.q_heads, args.kv_heads = 64, 48, 20, 4, 2
    elif torch.cuda.is_available():
        device, dtype = torch.device("cuda"), torch.bfloat16
    else:
        print("no CUDA device (use --cpu-smoke for a dry run)")
        return 2
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    names = args.backends.split(",")
    tn_bs, tn_ctx = (int(x) for x in args.torch_native_max.split(","))
    bandwidth = copy_bandwidth(device)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"device {gpu}, torch {torch.__version__}, copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
        f"{args.layers} decoder layers (self + cross), Hq {args.q_heads} Hk {args.kv_heads} D {args.head_dim}, "
        f"window {args.window}, encoder ~{args.encoder_len}, page {args.page_size}, bf16"
    )
    variants = []
    for name in names:
        if name == "flash_attention":
            variants.append((name, "", {}))
        elif name == "flashinfer":
            variants.append((name, "", {"kernel_backend": args.flashinfer_kernel_backend}))
        else:
            variants.append((name, "", {}))
    header = f"{'batch':>5} {'ctx':>6} {'backend':<16} {'variant':<12} {'eager ms':>9} {'graph ms':>9} {'floor ms':>9} {'graph/floor':>11} provider"
    print(header)
    for bs in sizes:
        for ctx in contexts:
            floor_ms = kv_bytes(args, bs, ctx, encoder_lens(args, bs), dtype) / bandwidth * 1e3
            for name, label, options in variants:
                if name == "torch_native" and (bs > tn_bs or ctx > tn_ctx):
                    continue
                try:
                    eager = run_case(args, name, options, False, bs, ctx, device, dtype)
                    graph, note = None, ""
                    if name != "torch_native":
                        try:
                            graph = run_case(args, name, options, True, bs, ctx, device, dtype)
                        except MmgenError as exc:  # e.g. the reference kernels cannot be captured
                            note = f" (no graph: {exc})"
                    provider = provider_name(args, name, options, device, dtype)
                    g = f"{graph:9.3f}" if graph is not None else f"{'-':>9}"
                    ratio = f"{graph / floor_ms:11.1f}" if graph is not None else f"{'-':>11}"
                    print(
                        f"{bs:>5} {ctx:>6} {name:<16} {label:<12} {eager:9.3f} {g} {floor_ms:9.4f} {ratio} "
                        f"{provider}{note}",
                        flush=True,
                    )
                except Exception as exc:  # keep going: one failing configuration is one row
                    print(
                        f"{bs:>5} {ctx:>6} {name:<16} {label:<12} ERROR {type(exc).__name__}: {exc}"[:160],
                        flush=True,
                    )
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return 0


def provider_name(args, name: str, options: dict, device, dtype) -> str:
    if name == "torch_native":
        return "torch"
    req_pool, kv_pool, _, _ = setup(args, 1, 1, device, dtype)
    backend = make_backend(name, req_pool, kv_pool, attention_layers(args), **options)
    return getattr(backend.provider, "name", "?")


if __name__ == "__main__":
    sys.exit(main())
