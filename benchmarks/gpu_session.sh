#!/usr/bin/env bash
# One lent-GPU call that measures this wave's issues at Wan2.1-1.3B sizes (the 14B rows need more device
# time than a session has): unpack the .gpu bundles (GPU.md), run each benchmark under its own time limit,
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
run offload_step "$each" python3 benchmarks/offload_step.py --model 1.3b --caps 4 --iters 2 --skip-pipeline
# The whole 1.3B 480p pipeline (UMT5-XXL, DiT, VAE) under 8 and 4 GiB: seconds and peak per stage, ~80 s.
run offload_pipeline 150 python3 benchmarks/offload_step.py --model 1.3b --caps 8,4 --iters 1 --steps 2 --skip-diffusers --no-chunk-rows
# Wan2.1-14B 720p DiT step at 24/12/8 GiB vs resident, diffusers block_level at 12 and 8 GiB: ~290 s on an H100.
run offload_step_14b 420 python3 benchmarks/offload_step.py --model 14b --caps 24,12,8 --iters 1 --warmup 1 --cap-warmup 0 --skip-pipeline --diffusers-caps 12,8 --no-diffusers-resident
run lora_step "$each" python3 benchmarks/lora_step.py --model 1.3b --ranks 32,128 --warmup 1 --iters 3 --cfg-run 3
# issue 10 (Wan variants at real sizes, 14B/5B random bf16 weights built on the GPU). H100 estimates
# (python3 benchmarks/variants_step.py --estimate): ~70 s and ~165 s; split across calls if needed.
run variants_i2v_ti2v 150 python3 benchmarks/variants_step.py --case i2v-14b --case ti2v-5b
run variants_a14b 270 python3 benchmarks/variants_step.py --case a14b
