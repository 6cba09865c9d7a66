#!/usr/bin/env bash
# Run named GPU benchmarks and CUDA tests on a GPU host, each under its own time limit, keeping every
# table in $OUT/<name>.txt (default /tmp/mmgen-gpu). The packages come from the .gpu/ bundles
# (benchmarks/gpu_bundle.sh, benchmarks/README.md). Run from the repository root:
#
#   bash benchmarks/gpu_session.sh NAME [NAME ...]     # the names below; `all` runs every one (~1 hour)
#
# A line's comment says what it needs (bundles) and about how long it takes on one H100.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/mmgen-gpu}
mkdir -p "$out"
eval "$(bash benchmarks/gpu_bundle.sh unpack)"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0  # no NVLink multicast (the lent multi-GPU hosts run without it)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"

run() {  # name, seconds, command...
  local name=$1 seconds=$2
  shift 2
  echo "=== $name (limit ${seconds}s)"
  local start=$SECONDS
  timeout --signal=TERM "$seconds" "$@" > "$out/$name.txt" 2>&1
  echo "rc $? after $((SECONDS - start)) s"
  tail -40 "$out/$name.txt"
}

bench() {
  case $1 in
    # Wan step vs diffusers and the floor (RESULTS.md 2-4, 7); diffusers + fa3fwd (fa4 optional): ~4 min / ~7 min
    dit_step) run "$1" 400 python3 benchmarks/dit_step.py --model 1.3b ;;
    dit_step_14b) run "$1" 560 python3 benchmarks/dit_step.py --model 14b --iters 1 --no-compile ;;
    # one guided Wan2.1-VACE-14B step at 480p vs diffusers' WanVACETransformer3DModel; diffusers (+ fa3fwd)
    vace_step) run "$1" 500 python3 benchmarks/vace_step.py ;;
    # one Qwen-Image true-CFG step at 1328x1328 (RESULTS.md 14, 18); diffusers + fa3fwd: ~80 s
    qwen_image_step) run "$1" 300 python3 benchmarks/qwen_image_step.py --profile 12 ;;
    # Qwen-Image-2.1 steps (uncached, prefill, cached) at 1024/1536 and an edit, vs diffusers (RESULTS.md 20); diffusers + fa3fwd: ~3 min
    qwen_image21_step) run "$1" 400 python3 benchmarks/qwen_image21_step.py --profile 10 ;;
    # Qwen-Image-2.1 end to end vs diffusers' QwenImage21Pipeline: 1024x1024, 40 steps, KV cache on, T2I and an
    # edit with one 1024x1024 condition image; random 7.12 B transformer + Qwen3-VL-8B (~30 GiB); diffusers (+ fa3fwd): ~2.5 min
    qwen_image21_e2e) run "$1" 420 python3 benchmarks/qwen_image21_e2e.py --json "$out/qwen_image21_e2e.json" ;;
    # the same and mmgen with Ulysses over 2 GPUs (a 2-GPU kind; the anchor: SGLang's 2.91 s on two H100s): ~4 min
    qwen_image21_e2e_2gpu) run "$1" 560 python3 benchmarks/qwen_image21_e2e.py --gpus 2 \
      --json "$out/qwen_image21_e2e_2gpu.json" ;;
    # a started rank's primary CUDA context made through the driver API is the one torch then uses: seconds
    cuda_context_test) run "$1" 120 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/test_cuda_context.py ;;
    # the denoise loop's StepFence on CUDA (one step queued ahead): seconds
    step_fence_cuda_test) run "$1" 120 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/test_denoise_loop.py -k cuda ;;
    # the Ulysses 2 ranks' kernels, wall against device time, collectives' share (a 2-GPU kind): ~2 min
    qwen21_profile_2gpu) run "$1" 300 python3 benchmarks/qwen_image21_e2e.py --gpus 2 --profile 30 --cases t2i,edit ;;
    # cold start of `mmgen generate` (issue 37): writes a random Wan2.1-1.3B + UMT5-XXL directory, then fresh
    # processes on 1 and 2 GPUs (a 2-GPU kind); ffmpeg + pydantic (+ fa3fwd): ~5 min
    cold_start_13b) run "$1" 560 python3 benchmarks/cold_start.py --write wan-1.3b --model /tmp/mmgen-cold-13b \
      --device cuda --runs 2 --gpus 1,2 --size 480 832 21 --profile-first-call 30 --json "$out/cold_start_13b.json" ;;
    # the same with bytecode cached as a pip install has it (the lent hosts set PYTHONDONTWRITEBYTECODE=1 and
    # their torch has no __pycache__: every import compiles its sources): ~3 min
    cold_start_13b_bytecode) run "$1" 560 env PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=/tmp/mmgen-pycache \
      python3 benchmarks/cold_start.py --write wan-1.3b --model /tmp/mmgen-cold-13b --device cuda --runs 3 \
      --gpus 1,2 --size 480 832 21 --profile-first-call 30 --json "$out/cold_start_13b_bytecode.json" ;;
    # the ranks of `generate --gpus N` against the launcher's parse: their imports and their world's set-up,
    # 3 fresh launchers per N (a multi-GPU kind; pydantic): ~1-2 min
    rank_start) run "$1" 240 python3 benchmarks/rank_start.py --device cuda --gpus 2 --runs 3 \
      --json "$out/rank_start.json" ;;
    # the same for Wan2.1-14B + UMT5-XXL (~40 GB outside vae/, written in ~2-3 min; a 2-GPU kind, whose
    # 128 GiB disk holds it; --gpus 1,4 on a 4-GPU kind), two runs per row after one untimed each, 5 frames,
    # bytecode cached (as cold_start_13b_bytecode); removed after: ~8 min
    cold_start_14b) run "$1" 590 env PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=/tmp/mmgen-pycache \
      python3 benchmarks/cold_start.py --write wan-14b --model /tmp/mmgen-cold-14b \
      --device cuda --runs 2 --gpus 1,2 --size 480 832 5 --json "$out/cold_start_14b.json"
      rm -rf /tmp/mmgen-cold-14b ;;
    # Qwen-Image (20B transformer + Qwen2.5-VL-7B, ~62 GB: more than a 1-GPU kind's 64 GiB disk; written in ~1-2
    # min), one GPU (the Qwen-Image pipeline runs in one process), 512x512, 1 step, bytecode cached as a pip
    # install has it (as cold_start_13b_bytecode); + diffusers, transformers: ~4 min, removed after
    cold_start_qwen) run "$1" 540 env PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=/tmp/mmgen-pycache \
      python3 benchmarks/cold_start.py --write qwen-image --model /tmp/mmgen-cold-qwen \
      --device cuda --runs 2 --size 512 512 1 --json "$out/cold_start_qwen.json"
      rm -rf /tmp/mmgen-cold-qwen ;;
    # a leading launcher (`generate --gpus N`'s process is rank 0) under NCCL: its ranks, and a failed rank ending the
    # run within seconds, not at NCCL's timeout (2 GPUs: ~1 min)
    lead_cuda_tests) run "$1" 180 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/test_parallel_lead.py ;;
    # when each rank of `generate --gpus 2` reaches each point of its join and load (cold_start_13b_bytecode's model
    # directory, written first when missing; bytecode cached likewise): ~1-2 min
    rank_timeline_13b) [ -d /tmp/mmgen-cold-13b ] || python3 benchmarks/cold_start.py --write wan-1.3b \
      --model /tmp/mmgen-cold-13b --device cuda --runs 1 --no-cli > /dev/null
      run "$1" 240 env PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=/tmp/mmgen-pycache \
      python3 benchmarks/rank_timeline.py --model /tmp/mmgen-cold-13b --device cuda --runs 3 --size 480 832 21 ;;
    # the same with NCCL's own split of each communicator's init (NCCL_DEBUG=INFO, INIT): where its 1.0-1.2 s go
    rank_timeline_13b_nccl) [ -d /tmp/mmgen-cold-13b ] || python3 benchmarks/cold_start.py --write wan-1.3b \
      --model /tmp/mmgen-cold-13b --device cuda --runs 1 --no-cli > /dev/null
      run "$1" 240 env PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=/tmp/mmgen-pycache NCCL_DEBUG=INFO \
      NCCL_DEBUG_SUBSYS=INIT python3 benchmarks/rank_timeline.py --model /tmp/mmgen-cold-13b --device cuda --runs 2 ;;
    # a change's start, A/B by checkout (RESULTS.md 28): BEFORE=DIR (`git archive BASE mmgen pipelines | tar -x -C DIR`)
    # against this tree, Wan 1.3B + UMT5-XXL at 1 / 2 / 4 GPUs (the host's count); ~3 min on 4 GPUs
    start_ab_13b) [ -d /tmp/mmgen-cold-13b ] || python3 benchmarks/cold_start.py --write wan-1.3b \
      --model /tmp/mmgen-cold-13b --device cuda --runs 1 --no-cli > /dev/null
      gpus=$(nvidia-smi -L | wc -l); counts=1; [ "$gpus" -ge 2 ] && counts=1,2; [ "$gpus" -ge 4 ] && counts=1,2,4
      run "$1" 400 env PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=/tmp/mmgen-pycache python3 benchmarks/start_ab.py \
      --model /tmp/mmgen-cold-13b --gpus "$counts" --runs 3 --size 480 832 21 --trees "${BEFORE:?BEFORE=DIR}" . ;;
    # the host's fresh reads by method, threads and processes, then each component's upload as a new process does
    # it, from the mapping and with os.preadv (RESULTS 30; the 1.3B model directory as above): ~2 min
    upload_rate_13b) [ -d /tmp/mmgen-cold-13b ] || python3 benchmarks/cold_start.py --write wan-1.3b \
      --model /tmp/mmgen-cold-13b --device cuda --runs 1 --no-cli > /dev/null
      run "$1" 300 bash -c "python3 benchmarks/upload_rate.py --model /tmp/mmgen-cold-13b --reads && \
      python3 benchmarks/upload_rate.py --model /tmp/mmgen-cold-13b --runs 3 --read mapping && \
      python3 benchmarks/upload_rate.py --model /tmp/mmgen-cold-13b --runs 3 --read preadv" ;;
    # a 2-GPU world's join part by part (NCCL's init split, each warm-up collective), plain against NCCL's kernels
    # loaded beside the imports (a one-rank communicator made early): ~1 min
    world_join) run "$1" 200 env PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=/tmp/mmgen-pycache \
      python3 benchmarks/world_join.py --runs 3 ;;
    # a DiT forward's first-call start-up per set-up (Triton's, cuBLAS/cuDNN's beside the load, a text encoder
    # pass before it), fresh processes, first calls profiled (mmgen.layers.kernel_set_up; RESULTS 27): ~1.5 min
    first_calls) run "$1" 400 env PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=/tmp/mmgen-pycache \
      python3 benchmarks/first_calls.py --runs 3 --profile ;;
    # the UMT5 text encoder's first-call start-up: cold, after Wan's first_kernels, after a same-shape call (RESULTS 31): ~1 min
    encoder_first_call) run "$1" 300 env PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=/tmp/mmgen-pycache \
      python3 benchmarks/encoder_first_call.py --runs 3 ;;
    # page-locking a host store of Wan2.1-1.3B + UMT5-XXL's size (14.2 GB) by method (RESULTS 31): ~1.5 min
    pin_rate_13b) [ -d /tmp/mmgen-cold-13b ] || python3 benchmarks/cold_start.py --write wan-1.3b \
      --model /tmp/mmgen-cold-13b --device cuda --runs 1 --no-cli > /dev/null
      run "$1" 300 python3 benchmarks/pin_rate.py --model /tmp/mmgen-cold-13b --runs 2 ;;
    # a shard's GEMM rows against the whole call's bits, split-K allowed and not, Wan 14B at 480x832x5 and 1.3B at
    # 480x832x21 (why the output head projects the gathered sequence; RESULTS 27): ~1 min
    gemm_rows) run "$1" 300 bash -c "python3 benchmarks/gemm_rows.py --model 14b --tokens 3120 && \
      python3 benchmarks/gemm_rows.py --model 1.3b --tokens 9360" ;;
    # the Wan output head's gather (dim columns) against its output's (64), 720p x 81, 4 and 2 GPUs: ~30 s
    head_gather) run "$1" 150 bash -c "python3 benchmarks/head_gather.py --gpus 4 && \
      python3 benchmarks/head_gather.py --gpus 2 --port 29572" ;;
    qwen21_2gpu_tests) run "$1" 200 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/test_qwen_image21_parallel.py -k two_gpus ;;
    # the packed q/k/v all-to-all over NCCL bit for bit, and the FA kernels on its strided views (2 GPUs; 1 runs the views half)
    ulysses_exchange_tests) run "$1" 200 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/test_ulysses_exchange.py ;;
    # one cached 2.1 step under Ulysses 2: eager, graph pieces cut at the all-to-alls, and one whole graph with
    # NCCL inside (does it hang at replay, as sglang#31852 found? the ranks are killed after 150 s); 2 GPUs: ~2-3 min
    step_graph_collectives) run "$1" 240 python3 benchmarks/step_graph_collectives.py --steps 20 --timeout-s 150 ;;
    # Qwen-Image-2.1's cached steps as CUDA graphs equal eager in bits, 1 GPU and Ulysses over 2 (NCCL): ~1 min
    step_graph_tests) run "$1" 240 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/test_step_graph.py ;;
    # 2.1's CUDA tests: segment attention, the row-kernel path vs op by op, and the silu(gate) * up kernel
    qwen21_cuda_tests) run "$1" 200 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/test_qwen_image21_model.py \
      tests/test_fused_activations.py -k cuda ;;
    # Qwen-Image end to end vs diffusers, 50 steps (RESULTS.md 18); diffusers + fa3fwd: ~2.5 min
    qwen_image_e2e) run "$1" 400 python3 benchmarks/qwen_image_e2e.py --steps 50 ;;
    # the whole pipeline, mmgen vs diffusers' WanPipeline, 10 steps (RESULTS.md 3, 5); diffusers + fa3fwd: ~2 min
    pipeline_e2e) run "$1" 300 python3 benchmarks/pipeline_e2e.py --steps 10 ;;
    # the pipeline under GPU memory caps (RESULTS.md 9c); diffusers (+ fa3fwd): ~80 s / ~5 min
    offload_pipeline) run "$1" 200 python3 benchmarks/offload_pipeline.py --model 1.3b --caps 8,4 ;;
    offload_pipeline_14b) run "$1" 480 python3 benchmarks/offload_pipeline.py --model 14b --caps 24,12,8 ;;
    # LoRA per step, unfused and fused (RESULTS.md 10c); fa3fwd: ~2 min / ~3 min
    lora_step) run "$1" 200 python3 benchmarks/lora_step.py --model 1.3b --ranks 32,128 --warmup 1 --iters 3 ;;
    lora_step_14b) run "$1" 240 python3 benchmarks/lora_step.py --model 14b --batch 1 --ranks 32 --warmup 1 --iters 2 ;;
    # the lossy settings end to end (RESULTS.md 12e); diffusers + fa3fwd: ~4 min / ~6 min
    lossy_e2e) run "$1" 480 python3 benchmarks/lossy_e2e.py --model 1.3b --steps 50 ;;
    lossy_e2e_14b) run "$1" 480 python3 benchmarks/lossy_e2e.py --model 14b --steps 8 --settings lossless,fast \
      --vae-dtype bfloat16 --warmup-steps 1 ;;
    # served vs direct throughput and the server's per-job overhead (issue 27): writes a random-weight
    # Wan2.1-T2V-1.3B directory (UMT5-XXL, 14 GiB) to /tmp, then 10 jobs 832x480 x 33 frames x 4 steps
    # (+1 warmup) direct and through `mmgen serve`, 8 clients; diffusers + pydantic + serve + ffmpeg
    # (+ fa3fwd): ~2.5 min
    # `mmgen render --ray` with one replica per GPU (issue 29; a 2-GPU kind); ray + ffmpeg + diffusers + pydantic: ~3 min
    render_ray_gpu) run "$1" 420 python3 benchmarks/render_ray.py --device cuda --gpus 2 --cpus 4 \
      --make-random-wan13b /tmp/mmgen-wan13b-random --size 832x480 --frames 33 --steps 4 --jobs 8 \
      --json "$out/render_ray_gpu.json" ;;
    serve_load_gpu) run "$1" 280 python3 benchmarks/serve_load.py --make-random-wan13b /tmp/mmgen-wan13b-random \
      --device cuda --dtype bfloat16 --size 832x480 --frames 33 --steps 4 --jobs 10 --clients 8 --warmup 1 \
      --timeout-s 150 --poll-s 0.1 --json "$out/serve_load_gpu.json" ;;
    # `mmgen serve` on several GPUs (issue 38): jobs/hour, e2e and queue-wait p50/p99, lost, 5xx and SHAs vs
    # the one-GPU server, 16 jobs of 832x480 x 33 frames x 4 steps from 8 clients (polling every 0.1 s) after 1
    # warm-up job per replica, per layout one after another; random Wan2.1-1.3B + reduced UMT5 written to
    # /tmp/mmgen-wan13b-scale (kept: scale_out's directory, reused on a warm host); a local Ray cluster for
    # rayN. ray + serve + pydantic + ffmpeg + diffusers (+ fa3fwd). Estimates from 15b (one job 2.7 s in the
    # pipeline + 1.1 s mp4 export in the server) and ~0.35 s/step, ~1.5 s decode: script + writing ~1 min;
    # per layout a server start ~25-45 s (spawn, load, NCCL / actors), warm-up ~10 s, 16 jobs ~60 s (1 GPU),
    # ~50 s (u2; u4 ~45 s: the decode and the export stay whole), ~35 s (ray2; ray4 likely bound by the
    # server's one export thread, ~1.2 s a job: ~25 s), stop ~5 s.
    # 2-GPU kind: 1, u2, ray2: ~6 min.
    serve_scale_2gpu) run "$1" 540 python3 benchmarks/serve_scale.py --make-random wan13b /tmp/mmgen-wan13b-scale \
      --layouts 1,u2,ray2 --size 832x480 --frames 33 --steps 4 --jobs 16 --clients 8 --warmup 1 \
      --ready-timeout-s 150 --timeout-s 120 --poll-s 0.1 --json "$out/serve_scale_2gpu.json" ;;
    # 4-GPU kind: 1, u4, ray4, then u2 (the last, so a slow host cuts it, not the others; SIGTERM prints
    # the layouts done and the JSON has them): ~7-7.5 min.
    serve_scale_4gpu) run "$1" 540 python3 benchmarks/serve_scale.py --make-random wan13b /tmp/mmgen-wan13b-scale \
      --layouts 1,u4,ray4,u2 --size 832x480 --frames 33 --steps 4 --jobs 16 --clients 8 --warmup 1 \
      --ready-timeout-s 150 --timeout-s 120 --poll-s 0.1 --json "$out/serve_scale_4gpu.json" ;;
    # every parallel layout the host's GPUs allow, one after another: per-step rate apart from the fixed
    # cost per job, decode (whole / split), sha vs 1 GPU, SM clock and power (issue 38; a 4-GPU kind);
    # diffusers + pydantic + fa3fwd. 1.3B 832x480x81 (~5 min).
    scale_out) run "$1" 580 python3 benchmarks/scale_out.py --make-random wan13b /tmp/mmgen-wan13b-scale \
      --steps 4,12 --json "$out/scale_out.json" ;;
    # Wan2.1-T2V-14B 1280x720x81 (random bf16 + reduced UMT5, 28.6 GB), steps 1,3 on every layout (the
    # same 3-step frames: sha vs 1 GPU), in two calls of one warm host sharing /tmp (all four layouts in
    # one call come to ~9-10 min: too close to the 10-minute limit). Estimates from 20.7 / 10.5 / ~5 s
    # per step on 1 / 2 / 4 GPUs, a ~10 s decode per job, ~25 s per group start (load from the page cache).
    # part1: script start ~20 s + writing the directory (~1-1.5 min) + 1 GPU (cold 1 + low 1 + high 3 steps,
    # 3 decodes: ~2.7 min): ~4-4.5 min.
    scale_out_14b_part1) run "$1" 580 python3 benchmarks/scale_out.py --make-random wan14b /tmp/mmgen-wan14b-scale \
      --size 1280x720 --steps 1,3 --layouts 1 --json /tmp/mmgen-scale-14b-part1.json
      cp /tmp/mmgen-scale-14b-part1.json "$out/scale_out_14b_part1.json" ;;
    # part2, after part1 on the same warm host (its 1 GPU row the baseline): Ulysses 2 (~2.1 min, with its
    # split-decode job), Ulysses 4 and CFG 2 x Ulysses 2 (~1.5 min each): ~5.5 min. On a fresh host it
    # writes the directory again (+1-1.5 min) and has no 1 GPU baseline.
    scale_out_14b_part2) run "$1" 580 python3 benchmarks/scale_out.py --make-random wan14b /tmp/mmgen-wan14b-scale \
      --size 1280x720 --steps 1,3 --layouts u2,u4,cfg2xu2 --json "$out/scale_out_14b_part2.json" \
      $([ -f /tmp/mmgen-scale-14b-part1.json ] && echo --baseline /tmp/mmgen-scale-14b-part1.json) ;;
    # part2 on a 4-GPU host whose 2-GPU rows are in RESULTS 21b: Ulysses 4 and CFG 2 x Ulysses 2 only (~3.5 min)
    scale_out_14b_part2_4gpu) run "$1" 580 python3 benchmarks/scale_out.py --make-random wan14b /tmp/mmgen-wan14b-scale \
      --size 1280x720 --steps 1,3 --layouts u4,cfg2xu2 --json "$out/scale_out_14b_part2_4gpu.json" \
      $([ -f /tmp/mmgen-scale-14b-part1.json ] && echo --baseline /tmp/mmgen-scale-14b-part1.json) ;;
    # Wan2.2-T2V-A14B end to end, 1280x720x81, 40 steps, guidance 5 (two random 14B experts + reduced UMT5,
    # 57 GB; the issue's anchor: SGLang 208.9 s on 4 H100s): per layout the group's start, a 1-step warm-up
    # job, then one 40-step job timed on rank 0. `--decode bands4` (4 bands spread over the ranks: exact up
    # to conv rounding; one GPU's bands4 bits on any number of GPUs, not the whole decode's): the whole fp32 720p decode beside both resident
    # experts (53.3 GiB) is estimated at 79.8 GiB a rank (mmgen.placement.policy), over an 80 GB H100
    # (drop --decode on H200s). Writing ~2-2.5 min; CFG 2 x Ulysses 2: start ~0.5 min + warm-up ~10 s +
    # the job ~3.4 min (40 x ~4.9 s + ~4 s decode): ~6.5-7 min in all.
    a14b_e2e) run "$1" 590 python3 benchmarks/scale_out.py --make-random a14b /tmp/mmgen-a14b-scale \
      --size 1280x720 --e2e 40 --decode bands4 --layouts cfg2xu2 --json "$out/a14b_e2e.json" ;;
    # the same on Ulysses 4, after a14b_e2e on the same warm host (~4.5 min; fresh host: +2-2.5 min writing)
    a14b_e2e_u4) run "$1" 590 python3 benchmarks/scale_out.py --make-random a14b /tmp/mmgen-a14b-scale \
      --size 1280x720 --e2e 40 --decode bands4 --layouts u4 --json "$out/a14b_e2e_u4.json" ;;
    # the bands4 decode spread over 1, 2 and 4 ranks: its seconds per layout and the same frames sha256 on
    # each (1.3B 832x480x81, 2 and 4 steps; a 4-GPU kind; as scale_out): ~4 min
    scale_out_bands4) run "$1" 400 python3 benchmarks/scale_out.py --make-random wan13b /tmp/mmgen-wan13b-scale \
      --steps 2,4 --decode bands4 --layouts 1,u2,u4 --no-split --json "$out/scale_out_bands4.json" ;;
    # rank 0's work per parallel layout on one GPU (RESULTS.md 8c); fa3fwd: ~1 min / ~2 min
    parallel_step) run "$1" 100 python3 benchmarks/parallel_step.py --model 1.3b --warmup 1 --iters 3 ;;
    parallel_step_14b) run "$1" 230 python3 benchmarks/parallel_step.py --model 14b --warmup 0 --iters 1 ;;
    # LLM decode step per backend vs the KV-read floor (RESULTS.md 6); fa4 and flashinfer clash in one
    # process (two tvm-ffi versions): one call each. flashinfer's first run JIT-builds for ~2 minutes.
    llm_decode) run "$1" 300 python3 benchmarks/llm_decode.py --backends torch_native,flash_attention ;;
    llm_decode_flashinfer) run "$1" 400 python3 benchmarks/llm_decode.py --backends flashinfer ;;
    # correctness on the real kernels (RESULTS.md 6): references vs FA3/FA4/FlashInfer; the LLM backends
    gpu_kernels_check) run "$1" 400 python3 benchmarks/gpu_kernels_check.py ;;
    gpu_llm_check) run "$1" 400 python3 benchmarks/gpu_llm_check.py --budget-s 330 ;;
    # CUDA-only tests (bundle pytest; lora also fa3fwd): LoRA kernels, FP8 producers, per-token row kernels
    lora_cuda_tests) run "$1" 180 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/test_lora_kernels.py \
      tests/test_lora_concat.py -k cuda ;;
    fp8_gpu_tests) run "$1" 120 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/test_fp8_gpu.py ;;
    ti2v_cuda_tests) run "$1" 150 python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/test_token_modulation.py \
      tests/test_wan_dit_fast.py::test_triton_row_kernels_match_the_torch_references \
      tests/test_fp8_gpu.py::test_norm_kernels_fp8_output_match_reference ;;
    *) echo "unknown benchmark $1"; return 2 ;;
  esac
}

names=("$@")
if [ "${names[0]:-all}" = all ]; then
  names=(dit_step pipeline_e2e offload_pipeline lora_step lossy_e2e parallel_step llm_decode gpu_kernels_check
    lora_cuda_tests fp8_gpu_tests ti2v_cuda_tests)
fi
for name in "${names[@]}"; do bench "$name"; done
