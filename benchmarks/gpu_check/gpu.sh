#!/usr/bin/env bash
# The real-GPU check's one command, run from the repository root on the lent
# GPU machine (no package index there) after `python -m
# benchmarks.gpu_check.prepare` made .gpu_carry here:
#
#   bash benchmarks/gpu_check/gpu.sh            results in $OUT (or /tmp/gpu-check-out)
#
# 1. installs the carried wheels and llama-cpp-python's Python package into
#    .gpu_work/site (the machine's own python3 has torch, numpy, httpx...);
# 2. takes the carried sm_90 build (llama-build-sm90.tar.gz) when it sees the
#    card; else builds llama-server and libllama from the carried llama.cpp:
#    with CUDA for this card only when nvidia-smi sees one, else for the CPU
#    (which is how this script is tried off the GPU machine). A build already
#    in .gpu_work is reused: delete .gpu_work/build to rebuild;
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

# The sm_90 build prepare.py packed from install.sh's CUDA build, when it came
# and sees the card: cuBLAS and the CUDA runtime from this machine's own
# NVIDIA wheels (PyTorch's). Else, or when it doesn't load, build here.
build="$work/build/bin" libs="$work/build/bin"
prebuilt="not carried"
if nvidia-smi -L >/dev/null 2>&1 && [ -f "$carry/llama-build-sm90.tar.gz" ]; then
  mkdir -p "$work/prebuilt" && tar xzf "$carry/llama-build-sm90.tar.gz" -C "$work/prebuilt"
  cuda_libs=$("$python" -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))" 2>/dev/null || true)
  prebuilt_path="$work/prebuilt/lib:$work/prebuilt/llama_cpp/lib${cuda_libs:+:$cuda_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  prebuilt_devices=$(LD_LIBRARY_PATH="$prebuilt_path" "$work/prebuilt/bin/llama-server" --list-devices 2>&1 \
                     | tee "$work/prebuilt-devices.txt" || true)
  if grep -q '^  CUDA0' <<<"$prebuilt_devices"; then
    build="$work/prebuilt/bin" libs="$work/prebuilt/llama_cpp/lib" prebuilt=used
    export LD_LIBRARY_PATH="$prebuilt_path"
  else
    # Said in build.json: what it printed last (a missing library, no device).
    prebuilt="unused: $(tail -n 1 <<<"$prebuilt_devices" | tr -d '"\\' | cut -c1-200)"
  fi
fi

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
if [ "$build" = "$work/prebuilt/bin" ]; then
  flags="prebuilt: install.sh's CUDA build, packed by prepare.py"
  cuda=ON
else
  [ -x "$work/build/bin/llama-server" ] || bash benchmarks/gpu_check/build_llama.sh "$work/llama.cpp" "$work/build" $flags
  # What the build was made with (a reused one may differ from $flags).
  cuda=$(grep -m1 '^GGML_CUDA:' "$work/build/CMakeCache.txt" | cut -d= -f2 || true)
fi
echo "{\"build_s\": $((SECONDS - build_started)), \"ggml_cuda\": \"$cuda\", \"flags\": \"$flags\", \"prebuilt\": \"$prebuilt\"}" \
  > "$out/build.json"
cp "$carry/manifest.json" "$out/carry-manifest.json"

export PYTHONPATH="$work/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export LLAMA_CPP_LIB_PATH="$libs"                 # llama-cpp-python's bindings load this libllama
export TRAY_APP_LLAMA_SERVER="$build/llama-server"
export PYTHONUNBUFFERED=1
"$python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, 'from', llama_cpp.__file__, 'GPU offload:', llama_cpp.llama_supports_gpu_offload())" || true
"$python" -m benchmarks.gpu_check.run --out "$out" --deadline-s $((${GPU_CHECK_LIMIT_S:-570} - SECONDS)) "$@" \
  && code=0 || code=$?
echo "gpu.sh: $((SECONDS - started)) s in all, build $(cat "$out/build.json")"
exit $code
