"""One question: what does the UMT5 text encoder's first call cost in a fresh GPU process, and how much of it
does `launch_first_kernels` (Wan's first_kernels, run in the kernels' set-up thread beside the load) take away?

    python3 benchmarks/encoder_first_call.py --runs 3        # one GPU, ~1 min

Each run of each mode is a fresh subprocess: torch imported, the libraries set up as the set-up thread
does (`library_set_up`), a UMT5-XXL-width encoder (2 layers, random bf16) built on the GPU, then
`encode_text`'s calls on two right-padded 512-token rows timed twice (synchronized; first minus second is
the first call's start-up). Modes: `cold` (nothing more), `tiny` (launch_first_kernels before the build),
`same` (the same encoder called once on the same shapes before: the most a warm-up could take away).
Also prints whether each mode imported sympy (torch's reference ops: ~0.3 s of imports holding the GIL).
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

MODES = ("cold", "tiny", "same")


def one_run(mode: str) -> dict:
    import torch
    from wan_models import random_weights

    from mmgen.layers.kernel_set_up import library_set_up
    from mmgen.models.umt5 import TextPadding, UMT5Config, UMT5Encoder, launch_first_kernels

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    library_set_up(device, torch.bfloat16)
    result: dict = {"mode": mode}
    if mode == "tiny":
        at = time.perf_counter()
        launch_first_kernels(device, torch.bfloat16)
        torch.cuda.synchronize()
        result["warm_up"] = time.perf_counter() - at
    config = UMT5Config(vocab_size=4096, d_model=4096, d_kv=64, d_ff=10240, num_layers=2, num_heads=64)
    with torch.device("meta"):
        encoder = UMT5Encoder(config)
    encoder = random_weights(encoder, device, torch.bfloat16)
    ids = torch.randint(0, 4096, (2, 512))
    mask = torch.zeros(2, 512, dtype=torch.int64)
    mask[0, :12], mask[1, :3] = 1, 1  # a prompt and a short negative, as encode_text gets them

    def call() -> None:
        with torch.no_grad():
            padding = TextPadding.from_mask(mask.to(device))
            encoder(ids.to(device), padding)
        torch.cuda.synchronize()

    if mode == "same":
        call()
    for name in ("first", "second"):
        at = time.perf_counter()
        call()
        result[name] = time.perf_counter() - at
    result["start_up"] = result["first"] - result["second"]
    result["sympy"] = "sympy" in sys.modules
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a subprocess's mode
    args = parser.parse_args()
    if args.one:
        print(RESULT + json.dumps(one_run(args.one)), flush=True)
        return
    subprocess.run([sys.executable, __file__, "--one", "cold"], capture_output=True)  # untimed: disk caches
    results = fresh_rounds(
        args.runs,
        args.modes,
        lambda mode: [sys.executable, __file__, "--one", mode],
        lambda row: (
            f"warm_up {row.get('warm_up', 0):5.3f} first {row['first']:5.3f} second {row['second']:5.3f} "
            f"start-up {row['start_up']:5.3f} sympy {row['sympy']}"
        ),
    )
    starts = {mode: [row["start_up"] for row in rows] for mode, rows in results.items()}
    print_medians("start-up s (median of runs)", starts, 5)


if __name__ == "__main__":
    main()
