#!/usr/bin/env bash
# The GPU-only Python packages the benchmarks need, for a GPU host without network access (x86_64,
# CPython 3.12, PyTorch with CUDA, transformers already installed). benchmarks/README.md explains.
#
#   bash benchmarks/gpu_bundle.sh pack STACK...       # where pip reaches an index: writes .gpu/STACK.tar.xz
#   eval "$(bash benchmarks/gpu_bundle.sh unpack)"    # on the GPU host: unpacks .gpu/*.tar.xz into .gpu/site
#                                                     # and prints the environment to use them
#   STACK: fa4 fa3fwd flashinfer diffusers pydantic pytest serve ffmpeg ray
#
# A bundle is the stack's wheels installed into one tree for the host's interpreter, packed as an xz
# tarball (3-4x smaller than the wheels, which are zips). GPU_BUNDLES overrides the folder (.gpu/ in the
# repository root, ignored by git).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${GPU_BUNDLES:-$root/.gpu}

stacks="fa4 fa3fwd flashinfer diffusers pydantic pytest serve ffmpeg ray"

wheels_of() {  # the pinned wheels of a stack: the versions benchmarks/RESULTS.md was measured with
  case $1 in
    fa4) echo flash-attn-4==4.0.0b36 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 \
      nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
      nvidia-cutlass-dsl-libs-cu13==4.8.1 ;;
    fa3fwd) echo fa3-fwd==0.0.3 ;;
    flashinfer) echo flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 ;;
    diffusers) echo diffusers==0.42.1 ;;
    pydantic) echo pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 ;;
    pytest) echo pytest==9.0.3 iniconfig==2.3.0 pluggy==1.6.0 ;;
    # `mmgen serve` (with the pydantic stack): fastapi's and uvicorn's closure for CPython 3.12, all pure Python
    serve) echo fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 h11==0.16.0 click==8.5.1 anyio==4.16.0 \
      sniffio==1.3.1 idna==3.20 prometheus-client==0.26.0 python-multipart==0.0.34 typing-extensions==4.16.0 \
      annotated-doc==0.0.7 opentelemetry-api==1.45.2 ;;
    # mp4 export (ffmpeg 7.0.2 static; 0.8.x's wheel is 68 MB): ~20 MB packed
    ffmpeg) echo imageio-ffmpeg==0.7.0 ;;
    # Ray core for `mmgen render/serve --ray` (click comes with serve): ~21 MB packed after pruning
    ray) echo ray==2.60.0 msgpack==1.1.2 protobuf==7.36.2 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
      referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 ;;
    *) echo "unknown stack '$1': $stacks" >&2; return 2 ;;
  esac
}

pruned_of() {  # what a stack's tree does not need here (relative paths): Ray's Java jars, its libraries
  case $1 in   # (RLlib, Data, Tune, Train, LLM) and the dashboard's web build, ~70 of its 220 MB
    ray) echo ray/jars ray/rllib ray/data ray/tune ray/train ray/llm ray/dashboard/client/build ;;
  esac
}

# pip's options for the host's interpreter and platform, wherever pack runs
host=(--only-binary=:all: --python-version 3.12 --implementation cp)
for platform in manylinux_2_28_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  host+=(--platform "$platform")
done

pack() {
  [ $# -gt 0 ] || { echo "name the stacks to pack: $stacks" >&2; exit 2; }
  mkdir -p "$dir"
  for stack in "$@"; do
    local wheels work
    wheels=$(wheels_of "$stack")
    work=$(mktemp -d)
    # shellcheck disable=SC2086  # $wheels is a list of requirement words
    python3 -m pip download -q --no-deps "${host[@]}" -d "$work/wheels" $wheels
    python3 -m pip install -q --no-deps --no-index --no-compile "${host[@]}" --target "$work/site" "$work"/wheels/*.whl
    for path in $(pruned_of "$stack"); do rm -rf "${work:?}/site/$path"; done
    tar -C "$work/site" -cf - . | xz -T0 -9e > "$dir/$stack.tar.xz"
    rm -rf "$work"
    echo "$dir/$stack.tar.xz: $(du -m "$dir/$stack.tar.xz" | cut -f1) MiB" >&2
  done
}

unpack() {
  mkdir -p "$dir/site"
  for bundle in "$dir"/*.tar.xz; do
    [ -e "$bundle" ] || continue
    local done_mark="$dir/site/.$(basename "$bundle").done"
    if [ ! "$done_mark" -nt "$bundle" ]; then
      tar -C "$dir/site" -xJf "$bundle" && touch "$done_mark"
      echo "unpacked $(basename "$bundle")" >&2
    fi
  done
  # cutlass-dsl (fa4) finds its packages through a .pth file, which PYTHONPATH entries do not read:
  # its folder is named explicitly. FlashInfer's JIT builds (1-2 minutes each) are kept under .gpu/.
  echo "export PYTHONPATH=$dir/site:$dir/site/nvidia_cutlass_dsl/dsl_packages:$root\${PYTHONPATH:+:\$PYTHONPATH}"
  echo "export FLASHINFER_WORKSPACE_BASE=\${FLASHINFER_WORKSPACE_BASE:-$dir/flashinfer_workspace}"
}

case ${1:-} in
  pack) shift; pack "$@" ;;
  unpack) unpack ;;
  *) sed -n '2,13p' "$0" >&2; exit 2 ;;
esac
