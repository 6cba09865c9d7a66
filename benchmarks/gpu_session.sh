#!/usr/bin/env bash
# One lent-GPU call that measures this wave's issues (1.3B sizes; the 14B parallel rows in one step per
# row, ~2 min on an H100): unpack the .gpu bundles (GPU.md), run each benchmark under its own time limit,
# keep every table in $OUT/<name>.txt. Usage on the GPU host: bash benchmarks/gpu_session.sh [SECONDS_EACH]
set -u
each=${1:-100}
out=${OUT:-/tmp/mmgen-gpu}
mkdir -p "$out" .gpu/site
for b in .gpu/*.tar.xz; do tar -C .gpu/site -xJf "$b"; done
export PYTHONPATH=$PWD/.gpu/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
run() {  # name, seconds, command...
  local name=$1 seconds=$2; shift 2
  echo "=== $name (limit ${seconds}s)"
  timeout --signal=TERM "$seconds" "$@" 2>&1 | tee "$out/$name.txt" | tail -40
}
run parallel_step "$each" python3 benchmarks/parallel_step.py --model 1.3b --warmup 1 --iters 3
run parallel_step_14b 230 python3 benchmarks/parallel_step.py --model 14b --warmup 0 --iters 1
run vae_split 90 python3 benchmarks/vae_split.py
run offload_step "$each" python3 benchmarks/offload_step.py --model 1.3b --caps 4 --iters 2 --steps 2
run lora_step "$each" python3 benchmarks/lora_step.py --model 1.3b --ranks 32,128 --warmup 1 --iters 3 --cfg-run 3
