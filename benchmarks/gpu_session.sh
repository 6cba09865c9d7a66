#!/usr/bin/env bash
# Lent-GPU measurements of this wave's issues: unpack the .gpu bundles (GPU.md), run each named benchmark
# under its own time limit, keep every table in $OUT/<name>.txt. A session's device time does not hold all
# of them: name the ones to run.  Usage on the GPU host: bash benchmarks/gpu_session.sh NAME [NAME ...]
# (names: the cases below; `all` runs every one, ~50 minutes on an H100).
set -u
out=${OUT:-/tmp/mmgen-gpu}
mkdir -p "$out" .gpu/site
for b in .gpu/*.tar.xz; do tar -C .gpu/site -xJf "$b"; done
export PYTHONPATH=$PWD/.gpu/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# pytest for the CUDA-only tests: the host has none; carry its wheels in .whl (pip download pytest -d .whl)
if [ -d .whl ]; then pip install -q --no-index --no-deps .whl/*.whl > /dev/null 2>&1; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
run() {  # name, seconds, command...
  local name=$1 seconds=$2; shift 2
  echo "=== $name (limit ${seconds}s)"
  local start=$SECONDS
  timeout --signal=TERM "$seconds" "$@" > "$out/$name.txt" 2>&1
  echo "rc $? after $((SECONDS - start)) s"
  tail -40 "$out/$name.txt"
}
bench() {
  case $1 in
    # issue 17: per-rank work of SP layouts (RESULTS 8c/8d)
    parallel_step) run "$1" 100 python3 benchmarks/parallel_step.py --model 1.3b --warmup 1 --iters 3 ;;
    # the 14B 720p rows, one step per row (~2 min)
    parallel_step_14b) run "$1" 230 python3 benchmarks/parallel_step.py --model 14b --warmup 0 --iters 1 ;;
    # rank 0's band of the split VAE decode vs the whole decode (RESULTS 8d), ~30 s
    vae_split) run "$1" 90 python3 benchmarks/vae_split.py ;;
    # issue 18: DiT step under caps (RESULTS 9)
    offload_step) run "$1" 100 python3 benchmarks/offload_step.py --model 1.3b --caps 4 --iters 2 --skip-pipeline ;;
    # 1.3B step at 4 and 2 GiB (2 GiB: sequential CFG + FFN chunks, the same batch-1 work per forward as
    # diffusers' group offloading) next to diffusers block_level / leaf_level at 4 GiB, same run: ~100 s
    offload_same_work) run "$1" 150 python3 benchmarks/offload_step.py --model 1.3b --caps 4,2 --iters 2 \
      --skip-pipeline --diffusers-caps 4 --no-chunk-rows ;;
    # the whole 1.3B 480p pipeline (UMT5-XXL, DiT, VAE) under 8 and 4 GiB: seconds and peak per stage, ~80 s
    offload_pipeline) run "$1" 140 python3 benchmarks/offload_step.py --model 1.3b --caps 8,4 --iters 1 --steps 2 \
      --skip-diffusers --no-chunk-rows --pipeline-resident ;;
    # the whole Wan2.1-14B 720p pipeline under 24 / 12 / 8 GiB and resident: seconds and peak per stage, with
    # diffusers' block_level offload at 24 GiB in the same run (it OOMs at 12 and 8: RESULTS 9b), ~330 s
    offload_pipeline_14b) run "$1" 430 python3 benchmarks/offload_step.py --model 14b --caps 24,12,8 --iters 1 \
      --warmup 1 --steps 2 --no-cap-rows --no-chunk-rows --no-batch1-row --pipeline-resident --diffusers-caps 24 \
      --no-diffusers-resident ;;
    # the 12 and 8 GiB 14B pipelines alone (a re-check of the stage peaks), ~200 s
    offload_pipeline_14b_low) run "$1" 260 python3 benchmarks/offload_step.py --model 14b --caps 12,8 --iters 1 \
      --warmup 1 --steps 2 --no-cap-rows --no-chunk-rows --no-batch1-row --skip-diffusers ;;
    # Wan2.1-14B 720p DiT step at 24/12/8 GiB vs resident, diffusers block_level at 12 and 8 GiB: ~290 s
    offload_step_14b) run "$1" 420 python3 benchmarks/offload_step.py --model 14b --caps 24,12,8 --iters 1 --warmup 1 \
      --cap-warmup 0 --skip-pipeline --diffusers-caps 12,8 --no-diffusers-resident ;;
    # the 24 GiB row alone (layer offload, batch-2 CFG) after the BlockStream first-copy fix: ~2 min
    offload_24_check) run "$1" 200 python3 benchmarks/offload_step.py --model 14b --caps 24 --iters 1 --warmup 1 \
      --cap-warmup 0 --skip-pipeline --skip-diffusers --no-chunk-rows --no-batch1-row ;;
    # issue 19: bytes model, mm-in-place check, FA3 output into padded rows (same bits, ms), per-linear table
    # (every kernel; concat with spare columns rounded to 8/64/128), step table at rank 32: fused-add vs concat
    # (now o-projections too, FA3 writing padded rows) and its 64/128 alignments, and fused (~100 s)
    lora_step) run "$1" 200 python3 benchmarks/lora_step.py --model 1.3b --ranks 32 --kernels fused-add,concat \
      --concat-aligns 8,64,128 --warmup 1 --iters 3 --no-e2e ;;
    lora_cuda_tests) run "$1" 180 python3 -m pytest -q -p no:randomly tests/test_lora_kernels.py tests/test_lora_concat.py -k cuda ;;
    # Wan2.1-14B 720p, batch 1 (~9.5 s a call): base, unfused auto, fused at rank 32, 3 calls a row (~170 s)
    lora_step_14b) run "$1" 240 python3 benchmarks/lora_step.py --model 14b --batch 1 --ranks 32 --kernels auto \
      --warmup 1 --iters 2 --no-micro --no-e2e ;;
    # issue 10: Wan variants at real sizes (14B/5B random bf16 weights built on the GPU): ~70 s and ~165 s
    variants_i2v_ti2v) run "$1" 150 python3 benchmarks/variants_step.py --case i2v-14b --case ti2v-5b ;;
    variants_a14b) run "$1" 270 python3 benchmarks/variants_step.py --case a14b ;;
    # TI2V-5B per-token modulation through the row kernels: the kernel count per call, diffusers, mmgen, and
    # mmgen on the torch row path for the before/after (~60 s); then the CUDA tests of those kernels (~40 s)
    variants_ti2v) run "$1" 150 python3 benchmarks/variants_step.py --case ti2v-5b --torch-rows ;;
    # the three row passes at TI2V's shape: kernel per sample vs per token vs torch (~15 s)
    ti2v_rows) run "$1" 90 python3 benchmarks/token_rows.py ;;
    ti2v_cuda_tests) run "$1" 150 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/test_token_modulation.py \
      tests/test_wan_dit_fast.py::test_triton_row_kernels_match_the_torch_references \
      tests/test_fp8_gpu.py::test_norm_kernels_fp8_output_match_reference ;;
    # issue 20: FP8 linears and attention (CUDA tests of the Triton producers, per-shape table, CFG step, attention)
    fp8_gpu_tests) run "$1" 120 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/test_fp8_gpu.py ;;
    fp8_linear) run "$1" 150 python3 benchmarks/fp8_linear.py --models 1.3b,14b --warmup 3 --iters 10 ;;
    fp8_step) run "$1" 150 python3 benchmarks/lossy_step.py --model 1.3b --fp8-step --warmup 1 --iters 3 ;;
    fp8_attention) run "$1" 120 python3 benchmarks/fp8_attention.py --models 1.3b,14b --warmup 2 --iters 5 ;;
    # the 20-step 1.3B 480p loop: lossless vs FP8 alone vs fast / fastest as shipped (with FP8), ~110 s
    lossy_presets) run "$1" 200 python3 benchmarks/lossy_step.py --model 1.3b --steps 20 --no-compile --presets ;;
    # the whole 50-step 1.3B 480p pipeline (UMT5-XXL, DiT, VAE) per setting: lossless, fp8, fast, fastest and two
    # candidate stronger `fast` settings, e2e and denoise speed-ups + the FP8 step table: ~270 s expected
    lossy_e2e) run "$1" 480 python3 benchmarks/lossy_e2e.py --model 1.3b --steps 50 ;;
    # 14B 720p, lossless vs fast, 8 steps (not 50: ~20 s per lossless step), bf16 VAE (fits 80 GB): ~360 s expected
    lossy_e2e_14b) run "$1" 480 python3 benchmarks/lossy_e2e.py --model 14b --steps 8 --settings lossless,fast \
      --vae-dtype bfloat16 --warmup-steps 1 --step-iters 0 ;;
    # 14B 720p CFG step: bf16 vs FP8 linears vs FP8 attention vs both (q/k/v stacked), one timed step each: ~180 s
    lossy_step_14b) run "$1" 300 python3 benchmarks/lossy_step.py --model 14b --fp8-step --fp8-short --warmup 1 --iters 1 ;;
    *) echo "unknown benchmark $1"; return 2 ;;
  esac
}
names=("$@")
if [ "${names[0]:-all}" = all ]; then
  names=(parallel_step parallel_step_14b vae_split offload_step offload_pipeline offload_pipeline_14b offload_step_14b lora_step lora_cuda_tests lora_step_14b
    variants_i2v_ti2v variants_a14b variants_ti2v ti2v_rows ti2v_cuda_tests fp8_gpu_tests fp8_linear fp8_step fp8_attention lossy_presets
    lossy_e2e lossy_e2e_14b lossy_step_14b)
fi
for name in "${names[@]}"; do bench "$name"; done
