"""One question: what does a DiT forward's first call cost in a fresh GPU process, and what of it does a
set-up thread beside the load (mmgen.layers.kernel_set_up) or a text encoder's pass before it take away?

    python3 benchmarks/first_calls.py --runs 2          # one GPU, ~1 min

A rank of `generate --gpus N` other than 0 runs no text encoder: its first denoise step meets cuBLAS's,
cuDNN's and the elementwise kernels' first calls that rank 0's encoder pass had already paid. Each run of
each mode is a fresh subprocess: torch imported, a random bf16 Wan2.1-1.3B DiT built on the GPU (the
load), then one guided step's forward at 480x832x21 timed twice (synchronized; first minus second is the
first call's start-up). Modes: `cold` (nothing else), `triton` (Triton's set-up thread started before
the build, joined before the forward), `setup` (the same thread also setting up cuBLAS and cuDNN),
`encoder+...` (a 2-layer UMT5-XXL-width encoder run on 512 tokens before the forward, as rank 0 does). Also lists each subprocess a process ran (Triton's tool
queries) with its seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_utils import RESULT, fresh_rounds, print_medians  # noqa: E402

MODES = ("cold", "triton", "setup", "encoder+triton", "encoder+setup")


def _log_subprocesses(seen: list) -> None:
    """Record every subprocess's argv and seconds (Popen's wait), this process only."""
    original_wait = subprocess.Popen.wait

    def wait(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return original_wait(self, *args, **kwargs)
        finally:
            seen.append((" ".join(map(str, self.args))[:80], round(time.perf_counter() - began, 3)))

    subprocess.Popen.wait = wait


def _profiled_call(call) -> None:
    """call() under cProfile; its 12 functions of most own time printed."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.runcall(call)
    stats = pstats.Stats(profile).stats
    for (file, line, name), (_, calls, own, total, _) in sorted(stats.items(), key=lambda i: -i[1][2])[:12]:
        print(f"    {own:7.3f} {total:7.3f} {calls:6d}  {os.path.basename(file)}:{line}({name})", flush=True)


def one_run(mode: str, profile: bool, tiny: bool) -> dict:
    seen: list = []
    _log_subprocesses(seen)
    began = time.perf_counter()
    import torch

    from mmgen.attention.selection import select_attention
    from mmgen.layers.kernel_set_up import start_kernel_set_up
    from mmgen.models.umt5 import UMT5Config, UMT5Encoder

    device = torch.device("cpu" if tiny else "cuda", 0)
    if not tiny:
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)
    result = {"mode": mode, "torch": time.perf_counter() - began}
    setup = None
    if "triton" in mode or "setup" in mode:  # triton: Triton's set-up only; setup: with the libraries'
        setup = start_kernel_set_up(device if "setup" in mode else torch.device("cpu"), torch.bfloat16)
    from wan_models import MODELS, TINY, TINY_VIDEO, make_inputs, random_dit, random_weights

    config, video = (TINY, TINY_VIDEO) if tiny else (MODELS["1.3b"][0], (480, 832, 21))
    sync = (lambda: None) if tiny else torch.cuda.synchronize
    at = time.perf_counter()
    model = random_dit(config, device)
    sync()
    result["build"] = time.perf_counter() - at
    if "encoder" in mode:
        at = time.perf_counter()
        text_config = UMT5Config(
            vocab_size=4096, d_model=4096, d_kv=64, d_ff=10240, num_layers=2, num_heads=64
        )
        with torch.device("meta"):
            encoder = UMT5Encoder(text_config)
        encoder = random_weights(encoder, device, torch.bfloat16)
        with torch.no_grad():
            encoder(torch.randint(0, 4096, (1, 512), device=device))
        sync()
        result["encoder"] = time.perf_counter() - at
    if setup is not None:
        at = time.perf_counter()
        setup.join()
        result["setup_wait"] = time.perf_counter() - at
    inputs = make_inputs(config, video, device)
    attention = select_attention("auto", device=device, dtype=torch.bfloat16, head_dim=128)

    def forward() -> None:
        with torch.no_grad():
            model(inputs.latents, inputs.timestep, inputs.text, attention=attention)
        sync()

    for name in ("first", "second"):
        sync()
        at = time.perf_counter()
        _profiled_call(forward) if profile and name == "first" else forward()
        result[name] = time.perf_counter() - at
    result["start_up"] = result["first"] - result["second"]
    result["subprocesses"] = seen
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--profile", action="store_true", help="one more run per mode, its first call profiled"
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny DiT on the CPU (this script's smoke run)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a subprocess's mode
    args = parser.parse_args()
    if args.one:
        print(RESULT + json.dumps(one_run(args.one, args.profile, args.tiny)), flush=True)
        return
    tiny = ["--tiny"] if args.tiny else []
    subprocess.run(
        [sys.executable, __file__, "--one", "cold", *tiny], capture_output=True
    )  # untimed: disk caches
    results = fresh_rounds(
        args.runs,
        args.modes,
        lambda mode: [sys.executable, __file__, "--one", mode, *tiny],
        lambda row: (
            f"torch {row['torch']:5.2f} build {row['build']:5.2f} encoder {row.get('encoder', 0):5.2f} "
            f"setup_wait {row.get('setup_wait', 0):5.2f} first {row['first']:5.3f} second {row['second']:5.3f} "
            f"start-up {row['start_up']:5.3f}  subprocesses {row['subprocesses']}"
        ),
    )
    for mode in args.modes if args.profile else ():
        command = [sys.executable, __file__, "--one", mode, "--profile", *tiny]
        done = subprocess.run(command, capture_output=True, text=True)
        print(f"{mode}: the first call's functions of most own time (s own, s total, calls)")
        print("\n".join(line for line in done.stdout.splitlines() if line.startswith("    ")))
    starts = {mode: [row["start_up"] for row in rows] for mode, rows in results.items()}
    print_medians("start-up s (median of runs)", starts, 14)


if __name__ == "__main__":
    main()
