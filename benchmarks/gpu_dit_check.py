"""GPU check of the Wan DiT: mmgen through FA4, FA3, FA2 and SDPA against diffusers, same random weights.

Run from the repository root on a CUDA machine with diffusers (and flash-attn-4 / fa3-fwd if present):

    python3 benchmarks/gpu_dit_check.py            # Wan2.1 1.3B config, bf16, 21x60x104 latents, 512 text tokens
    python3 benchmarks/gpu_dit_check.py --tiny     # a tiny config at small sizes (also runs on CPU)

Prints two tables. Kernels: each attention impl against the pure-torch reference on small dense and
varlen inputs (bf16). DiT: one forward of the 1.3B DiT (random weights; diffusers' bf16 loading rule,
norms/modulation/time MLP kept fp32) through each mmgen impl and through diffusers' default
attention: max abs and relative error (||a - b|| / ||b||) against diffusers bf16 and against a
diffusers fp32 forward, and the median ms per forward (CUDA events). A provider that is not
installed, or fails, is reported in its row and skipped.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from mmgen.attention import AttentionMetadata, FlashAttentionImpl, SDPAImpl  # noqa: E402
from mmgen.kernels.fa_providers import GPU_PROVIDERS, INSTALL_HINTS  # noqa: E402
from mmgen.kernels.fa_providers import probe_provider as load_provider  # noqa: E402
from mmgen.loading.wan_transformer import wan_dit_from_tensors  # noqa: E402
from mmgen.models.wan import WanConfig  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny config and sizes (a smoke run, CPU ok)")
    parser.add_argument("--frames", type=int, default=21, help="latent frames (81 video frames -> 21)")
    parser.add_argument("--height", type=int, default=60, help="latent height (480 / 8)")
    parser.add_argument("--width", type=int, default=104, help="latent width (832 / 8)")
    parser.add_argument("--text-len", type=int, default=512)
    parser.add_argument(
        "--prompt-tokens", type=int, default=40, help="valid tokens; the rest is zero padding"
    )
    parser.add_argument("--iters", type=int, default=3, help="timed forwards per impl (after one warm-up)")
    return parser.parse_args()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def timed(fn, iters: int, device: torch.device) -> tuple[torch.Tensor, float, float]:
    """(output, first-call seconds incl. compilation, median ms of `iters` further calls)."""
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - start
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            begin_s = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - begin_s) * 1e3)
    return out, first, statistics.median(times)


def candidate_impls(device: torch.device) -> list[tuple[str, object | str]]:
    """(label, impl or the reason it is skipped) for FA4, FA3, FA2 and SDPA."""
    rows = []
    for provider in ("fa4", "fa3", "fa2"):
        if device.type != "cuda":
            rows.append((provider, "skipped: needs CUDA"))
        elif load_provider(provider) is None:
            rows.append((provider, f"skipped: not installed ({INSTALL_HINTS[provider]})"))
        else:
            rows.append((provider, FlashAttentionImpl(provider)))
    rows.append(("sdpa", SDPAImpl()))
    return rows


def kernel_table(device: torch.device, tiny: bool) -> None:
    heads, head_dim = (2, 64) if tiny else (12, 128)
    seq_q, seq_k = (96, 40) if tiny else (2048, 512)
    gen = torch.Generator().manual_seed(0)

    def make(b, s):
        return torch.randn(b, s, heads, head_dim, generator=gen).to(device, torch.bfloat16)

    q, k, v, kq = make(2, seq_q), make(2, seq_k), make(2, seq_k), make(2, seq_q)
    lengths = torch.tensor([seq_k, seq_k // 7], device=device)
    cases = {
        "self dense": (q, kq, kq, AttentionMetadata()),
        "cross dense": (q, k, v, AttentionMetadata()),
        "cross varlen k": (q, k, v, AttentionMetadata.from_lengths(None, lengths)),
        "varlen q+k": (
            q,
            k,
            v,
            AttentionMetadata.from_lengths(torch.tensor([seq_q, seq_q // 3], device=device), lengths),
        ),
    }
    reference = FlashAttentionImpl("reference")
    expected = {name: reference(*case[:3], case[3]) for name, case in cases.items()}
    print(f"\nKernels vs the fp32 reference (bf16 inputs, H={heads}, D={head_dim}): max abs error")
    print(f"{'impl':<8} {'module':<22} " + " ".join(f"{name:>15}" for name in cases))
    for label, impl in candidate_impls(device):
        if isinstance(impl, str):
            print(f"{label:<8} {impl}")
            continue
        module = getattr(getattr(impl, "kernel", None), "module", "torch")
        try:
            errors = [max_abs(impl(*case[:3], case[3]), expected[name]) for name, case in cases.items()]
            print(f"{label:<8} {module:<22} " + " ".join(f"{e:>15.2e}" for e in errors))
        except Exception as err:  # report the failure and go on with the next provider
            print(f"{label:<8} {module:<22} failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}")


def dit_table(args: argparse.Namespace, device: torch.device) -> None:
    from diffusers import WanTransformer3DModel

    if args.tiny:
        config = WanConfig(
            num_attention_heads=2,
            attention_head_dim=64,
            in_channels=4,
            out_channels=4,
            text_dim=64,
            freq_dim=32,
            ffn_dim=256,
            num_layers=2,
        )
        frames, height, width, text_len, valid = 3, 8, 12, 32, 9
    else:
        config = WanConfig.wan21_t2v_1_3b()
        frames, height, width, text_len, valid = (
            args.frames,
            args.height,
            args.width,
            args.text_len,
            args.prompt_tokens,
        )
    torch.manual_seed(0)
    with torch.device(device):
        reference = WanTransformer3DModel(**config.to_diffusers_config()).eval().requires_grad_(False)
    model = wan_dit_from_tensors(
        config,
        {name: (t, Path("<random weights>")) for name, t in reference.state_dict().items()},
        source=Path("<random weights>"),
        dtype=torch.bfloat16,
        device=device,
    )
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(1, config.in_channels, frames, height, width, generator=gen).to(device)
    text = torch.randn(1, text_len, config.text_dim, generator=gen).to(device)
    text[:, valid:] = 0  # zero padding, attended densely as Wan was trained
    timestep = torch.tensor([500.0], device=device)
    tokens = frames * height * width // math.prod(config.patch_size)
    print(
        f"\nWan DiT {config.dim}d x {config.num_layers} layers, latents {tuple(latents.shape)} ({tokens} tokens), text {text_len}"
    )

    with torch.no_grad():
        truth = reference(latents, timestep, text, return_dict=False)[0]  # diffusers fp32
        keep = (
            WanTransformer3DModel._keep_in_fp32_modules
        )  # what from_pretrained(torch_dtype=bf16) keeps fp32
        for name, param in reference.named_parameters():
            if not any(part in keep for part in name.split(".")):
                param.data = param.data.to(torch.bfloat16)
        lat16, text16 = latents.bfloat16(), text.bfloat16()
        expected, first, ms = timed(
            lambda: reference(lat16, timestep, text16, return_dict=False)[0], args.iters, device
        )
        print(
            f"{'impl':<10} {'module':<22} {'max abs':>10} {'rel err':>10} {'rel vs fp32':>12} {'ms':>9} {'first s':>8}"
        )
        print(
            f"{'diffusers':<10} {'native sdpa':<22} {0.0:>10.2e} {0.0:>10.2e} "
            f"{relative_error(expected, truth):>12.2e} {ms:>9.1f} {first:>8.1f}"
        )
        for label, impl in candidate_impls(device):
            if isinstance(impl, str):
                print(f"{label:<10} {impl}")
                continue
            module = getattr(getattr(impl, "kernel", None), "module", "torch")
            try:
                out, first, ms = timed(
                    lambda impl=impl: model(latents, timestep, text, attention=impl), args.iters, device
                )
            except Exception as err:  # report the failure and go on with the next provider
                print(
                    f"{label:<10} {module:<22} failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
                )
                continue
            print(
                f"{label:<10} {module:<22} {max_abs(out, expected):>10.2e} {relative_error(out, expected):>10.2e} "
                f"{relative_error(out, truth):>12.2e} {ms:>9.1f} {first:>8.1f}"
            )


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.tiny:
        sys.exit("no CUDA device: run on a GPU, or pass --tiny for a CPU smoke run")
    import diffusers

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"device {name} | torch {torch.__version__} | CUDA {torch.version.cuda} | diffusers {diffusers.__version__}"
    )
    for provider in GPU_PROVIDERS:
        kernel = load_provider(provider)
        print(f"  {provider}: {kernel.module if kernel else 'not installed'}")
    kernel_table(device, args.tiny)
    dit_table(args, device)


if __name__ == "__main__":
    main()
