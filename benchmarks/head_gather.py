"""One question: what does gathering the Wan output head's input (dim columns per token) instead of its
output (out_channels x patch = 64 columns) cost a Ulysses step? (mmgen.models.wan.WanDiT.finish_call
gathers the normalized tokens so that the projection runs on one process's rows: exact frames.)

    python3 benchmarks/head_gather.py --gpus 4          # a 4-GPU host under NCCL, ~30 s
    python3 benchmarks/head_gather.py --gpus 2 --device cpu --tokens 64   # gloo smoke run

Each rank all-gathers its [2, tokens / N, columns] bf16 shard (a guided step's batch) as SequenceShard.gather
does (all_gather into a list, then the concatenation), columns 64 (the output) and dim (1536: 1.3B, 5120:
14B), at 720p x 81 frames' 75,600 tokens; median of 10 after 3 untimed, rank 0's wall per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, world: int, device_type: str, tokens: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world)
    rows = []
    for columns in (64, 1536, 5120):
        shard = torch.ones(2, tokens // world, columns, device=device, dtype=torch.bfloat16)
        times = []
        for index in range(13):
            if device_type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            began = time.perf_counter()
            parts = [torch.empty_like(shard) for _ in range(world)]
            dist.all_gather(parts, shard)
            torch.cat(parts, dim=1)
            if device_type == "cuda":
                torch.cuda.synchronize()
            if index >= 3:
                times.append(time.perf_counter() - began)
        megabytes = shard.numel() * 2 * world / 1e6
        rows.append((columns, megabytes, 1e3 * statistics.median(times)))
    if rank == 0:
        print(
            f"{world} ranks ({device_type}), {tokens} tokens, batch 2, bf16: the gathered tensor and ms per gather"
        )
        print(f"{'columns':>8} {'MB':>9} {'ms':>8}")
        for columns, megabytes, ms in rows:
            print(f"{columns:>8} {megabytes:9.1f} {ms:8.2f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tokens", type=int, default=75600, help="one sample's tokens (720p x 81: 75,600)")
    parser.add_argument("--port", type=int, default=29571)
    args = parser.parse_args()
    mp.spawn(rank_main, args=(args.gpus, args.device, args.tokens, args.port), nprocs=args.gpus)


if __name__ == "__main__":
    main()
