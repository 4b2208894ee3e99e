#!/usr/bin/env bash
# The real-GPU check's one command, run from the repository root on the lent
# GPU machine (no package index there) after `python -m
# benchmarks.gpu_check.prepare` made .gpu_carry here:
#
#   bash benchmarks/gpu_check/gpu.sh            results in $OUT (or /tmp/gpu-check-out)
#
# 1. installs the carried wheels and llama-cpp-python's Python package into
#    .gpu_work/site (the machine's own python3 has torch, numpy, httpx...);
# 2. builds llama-server and libllama from the carried llama.cpp: with CUDA
#    for this card only when nvidia-smi sees one, else for the CPU (which is
#    how this script is tried off the GPU machine). A build already in
#    .gpu_work is reused: delete .gpu_work/build to rebuild;
# 3. runs benchmarks/gpu_check/run.py with the service, the drill and the
#    router's tokenizer all on that build.
# Any extra arguments go to run.py (e.g. --checks replay,drill).
# The device tool gives one command 600 s: run.py gets what the build left
# of GPU_CHECK_LIMIT_S (default 570) and skips the checks that no longer fit;
# run again at once with --checks for those (the build is reused on a warm
# machine). At most 7 files go to $OUT: the tool brings back 8.
set -euo pipefail
ulimit -c 0  # the SIGABRT check must not wait for a core dump
cd "$(dirname "$0")/../.."
carry=.gpu_carry work=${GPU_CHECK_WORK:-.gpu_work}
out=${OUT:-/tmp/gpu-check-out}
python=${PYTHON:-python3}
[ -f "$carry/manifest.json" ] || { echo "no $carry: run python -m benchmarks.gpu_check.prepare first" >&2; exit 2; }
mkdir -p "$work/site" "$out"
work=$(cd "$work" && pwd)
started=$SECONDS

"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" \
  "$carry"/wheels/*.whl
tar xzf "$carry/llama_cpp_py.tar.gz" -C "$work/site"
[ -d "$work/llama.cpp" ] || tar xzf "$carry/llama.cpp.tar.gz" -C "$work"

if nvidia-smi -L >/dev/null 2>&1; then
  command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
  # This card only, machine code only (sm_90 on an H200, no PTX): a build
  # for every architecture would take most of the loan.
  flags="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES:-90-real}"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee "$out/nvidia-smi.csv"
else
  flags="-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
fi
build_started=$SECONDS
if [ ! -x "$work/build/bin/llama-server" ]; then
  bash benchmarks/gpu_check/build_llama.sh "$work/llama.cpp" "$work/build" $flags
fi
# What the build was made with (a reused one may differ from $flags).
cuda=$(grep -m1 '^GGML_CUDA:' "$work/build/CMakeCache.txt" | cut -d= -f2 || true)
echo "{\"build_s\": $((SECONDS - build_started)), \"ggml_cuda\": \"$cuda\", \"flags\": \"$flags\"}" > "$out/build.json"
cp "$carry/manifest.json" "$out/carry-manifest.json"

export PYTHONPATH="$work/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export LLAMA_CPP_LIB_PATH="$work/build/bin"       # llama-cpp-python's bindings load this libllama
export TRAY_APP_LLAMA_SERVER="$work/build/bin/llama-server"
export PYTHONUNBUFFERED=1
"$python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, 'from', llama_cpp.__file__, 'GPU offload:', llama_cpp.llama_supports_gpu_offload())" || true
"$python" -m benchmarks.gpu_check.run --out "$out" --deadline-s $((${GPU_CHECK_LIMIT_S:-570} - SECONDS)) "$@" \
  && code=0 || code=$?
echo "gpu.sh: $((SECONDS - started)) s in all, build $(cat "$out/build.json")"
exit $code
