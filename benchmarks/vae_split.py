"""Per-rank work of the split VAE decode (mmgen.parallel.vae_decode) on ONE GPU.

Question: how much of the Wan2.1 VAE decode does each rank still do when the decode is split into
spatial bands over 2, 4 and 8 ranks (halo recomputed, conv_in + mid block on every rank)? One
process decodes the whole video with diffusers (AutoencoderKLWan.decode) and then, for each rank
count, the widest rank's band (rank 0; bands differ by at most one latent column), timed the same
way. The gather of the uint8 bands is not timed (bytes: the video, 224 MiB at 720p, once).

    python3 benchmarks/vae_split.py                       # 480x832x81 and 720x1280x81, bf16, ~40 s on an H100
    python3 benchmarks/vae_split.py --tiny                # CPU smoke run (tiny VAE, fp32)

Random weights (diffusers' init) in bf16, made on the device. One warmup decode, then --iters.
The table is printed last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import numpy as np  # noqa: E402
import torch  # noqa: E402

from mmgen.parallel.vae_decode import decode_band, plan_bands  # noqa: E402

VIDEOS = {"480x832x81": (480, 832, 81), "720x1280x81": (720, 1280, 81)}
RANKS = (2, 4, 8)


def timed(fn, device: torch.device, iters: int) -> float:
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        tick = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - tick) * 1e3)
    return statistics.median(times)


def drop(video: torch.Tensor) -> np.ndarray:
    """The band's frames are dropped on the device (the uint8 conversion and gather are not timed)."""
    return np.zeros((0,), dtype=np.uint8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny VAE, fp32)")
    parser.add_argument("--iters", type=int, default=1)
    args = parser.parse_args()
    from diffusers import AutoencoderKLWan

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        if args.tiny:
            vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
        else:
            vae = AutoencoderKLWan()  # the Wan2.1 VAE's architecture
    vae = vae.to(dtype).eval()
    videos = {"64x128x9": (64, 128, 9)} if args.tiny else VIDEOS
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = []
    for name, (height, width, frames) in videos.items():
        z = torch.randn(1, 16, (frames - 1) // 4 + 1, height // 8, width // 8, device=device, dtype=dtype)
        with torch.no_grad():
            vae.decode(z[:, :, :2], return_dict=False)  # warmup: kernels, allocator
            full = timed(lambda z=z: vae.decode(z, return_dict=False), device, args.iters)
            rows.append(f"{name:12} {1:5} {'-':>14} {full:10.0f} {1.0:8.3f} {1.0:7.2f}")
            print(rows[-1], flush=True)
            for ranks in RANKS:
                plan = plan_bands(vae, tuple(z.shape), ranks)
                ms = timed(lambda p=plan, z=z: decode_band(vae, z, p, 0, drop), device, args.iters)
                band = f"{plan.bands[0][1] - plan.bands[0][0]} of {plan.length}"
                rows.append(f"{name:12} {ranks:5} {band:>14} {ms:10.0f} {ms / full:8.3f} {full / ms:7.2f}")
                print(rows[-1], flush=True)
        del z
    print(f"\nsplit VAE decode: rank 0's band vs the whole decode, {dtype}, one process")
    print(f"{'video':12} {'ranks':>5} {'band (latent)':>14} {'ms':>10} {'share':>8} {'speedup':>7}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
