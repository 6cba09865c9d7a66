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
run offload_step "$each" python3 benchmarks/offload_step.py --model 1.3b --caps 4 --iters 2 --steps 2
run lora_step "$each" python3 benchmarks/lora_step.py --model 1.3b --ranks 32,128 --warmup 1 --iters 3 --cfg-run 3
# issue 20, FP8 linear layers: the Triton producers and _scaled_mm against the references (~40 s, Triton JIT),
# every Wan linear shape bf16 vs FP8 with its quantization as it runs (~60 s), one 1.3B CFG step on vs off (~60 s)
run fp8_gpu_tests 120 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/test_fp8_gpu.py
run fp8_linear 150 python3 benchmarks/fp8_linear.py --models 1.3b,14b --warmup 3 --iters 10
run fp8_step 150 python3 benchmarks/lossy_step.py --model 1.3b --fp8-step --warmup 1 --iters 3
# issue 20 item 4: FA3 e4m3 forward (fa3-fwd 0.0.3 has it) vs its bf16 forward at Wan self-attention shapes (~40 s)
run fp8_attention 120 python3 benchmarks/fp8_attention.py --models 1.3b,14b --warmup 2 --iters 5
