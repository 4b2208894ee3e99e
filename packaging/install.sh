#!/usr/bin/env bash
# Installs tray-app into ./.venv on a fresh Linux machine.
#   bash packaging/install.sh          # the app, built for this machine's GPU
#   bash packaging/install.sh --test   # the app plus what the test suite needs
#   bash packaging/install.sh --plan   # say which backend it would build, and why; build nothing
#   --backend auto|cuda|vulkan|cpu     # override the choice (or TRAY_APP_BACKEND=...)
#   --cuda-arch 90                     # the CUDA architecture(s) to build for, ';'-separated (default: the card's)
#
# The backend (packaging/backend.sh): CUDA for an NVIDIA card when nvcc is
# there or the driver runs CUDA 13 (the toolkit then comes from NVIDIA's PyPI
# wheels), built for that card's architecture only; Vulkan for any NVIDIA, AMD
# or Intel card whose Vulkan build tools are there or, as root on
# Debian/Ubuntu, can be installed; the CPU otherwise, with one line saying
# what was missing and the command that would enable the GPU.
#
# llama-cpp-python ships as source only. We build it once into a wheelhouse
# keyed by its version, build flags and backend, because pip's own wheel cache
# ignores CMAKE_ARGS and would hand back a build made for other flags.
# The same build also makes llama.cpp's own llama-server (the default engine)
# from the llama.cpp that llama-cpp-python vendors: one compile of ggml and
# llama for both, the same tokenizer and chat template on every path. The
# wheel then carries bin/llama-server and its libraries in lib/, in llama.cpp's
# install layout; runtime.bundled_llama_server() finds it there.
# About 6 minutes on 2 cores the first time; cached after that.
# The default CPU flags are portable x86-64 (AVX2); `-march=native` builds have
# crashed with SIGILL on VMs that advertise AMX/AVX-512 but do not allow it.
# LLAMA_CMAKE_ARGS replaces those CPU flags; one that names a backend itself
# (-DGGML_CUDA=on) takes the place of the automatic choice.
#
# --test also builds a Vulkan llama-server for the tests that run llama.cpp's
# real Vulkan backend on Mesa's software device (packaging/build-vulkan-server.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source packaging/backend.sh

usage() {
  sed -n '2,8s/^# \{0,1\}//p' "$0"
}

WITH_TEST=0
PLAN_ONLY=0
REQUESTED="${TRAY_APP_BACKEND:-auto}"
while [ $# -gt 0 ]; do
  case "$1" in
    --test) WITH_TEST=1 ;;
    --plan) PLAN_ONLY=1 ;;
    --backend) [ $# -ge 2 ] || { echo "install.sh: --backend needs a value (auto, cuda, vulkan or cpu)" >&2; exit 2; }
               REQUESTED="$2"; shift ;;
    --backend=*) REQUESTED="${1#--backend=}" ;;
    --cuda-arch) [ $# -ge 2 ] || { echo "install.sh: --cuda-arch needs a value (90, or 8.9;9.0)" >&2; exit 2; }
                 CUDA_ARCHS="${2//./}"; shift ;;
    --cuda-arch=*) CUDA_ARCHS="${1#--cuda-arch=}"; CUDA_ARCHS="${CUDA_ARCHS//./}" ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

LLAMA_VERSION="${LLAMA_VERSION:-0.3.36}"
case "$(uname -m)" in
  x86_64) DEFAULT_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" ;;
  *)      DEFAULT_FLAGS="-DGGML_NATIVE=OFF" ;;
esac
LLAMA_CMAKE_ARGS="${LLAMA_CMAKE_ARGS:-$DEFAULT_FLAGS}"
# llama-server too: llama.cpp's tools, installed into the wheel. Its own
# multimodal library replaces llama-cpp-python's copy (LLAVA_BUILD would add
# the same folder twice); the web UI is off (it would be downloaded).
# GGML_RPC: llama-server's --rpc (other machines' devices, [gpu] rpc_servers)
# and ggml-rpc-server, which `tray-app rpc-worker` runs.
SERVER_FLAGS="-DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_TOOLS_INSTALL=ON -DLLAVA_BUILD=OFF -DGGML_RPC=ON \
 -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
PYTHON="${PYTHON:-python3}"

# A backend named in LLAMA_CMAKE_ARGS (the README's old CUDA recipe) is the
# user's choice already; otherwise detect.
named_backend=$(grep -oiE -- '-DGGML_(CUDA|VULKAN|HIP|SYCL|MUSA|OPENCL)=(ON|1|TRUE)' <<<"$LLAMA_CMAKE_ARGS" \
  | head -n1 | sed -E 's/^-DGGML_([A-Za-z]+)=.*/\1/' | tr '[:upper:]' '[:lower:]' || true)
if [ "$REQUESTED" = auto ] && [ -n "$named_backend" ]; then
  BACKEND="$named_backend" BACKEND_REASON="LLAMA_CMAKE_ARGS asks for it" BACKEND_FLAGS="" BACKEND_APT=""
elif ! choose_backend "$REQUESTED"; then
  echo "install.sh: $BACKEND_REASON" >&2
  exit 2
fi

if [ "$PLAN_ONLY" = 1 ]; then
  echo "backend: $BACKEND"
  echo "reason: $BACKEND_REASON"
  echo "cmake flags: $(echo $LLAMA_CMAKE_ARGS $BACKEND_FLAGS)"
  [ -z "$BACKEND_APT" ] || echo "apt packages (as root): $BACKEND_APT"
  [ "$BACKEND" != cuda ] || echo "build time: $CUDA_BUILD_TIME"
  [ "$WITH_TEST" = 0 ] || echo "test suite: also a Vulkan llama-server (packaging/build-vulkan-server.sh)"
  exit 0
fi
echo "backend: $BACKEND: $BACKEND_REASON"

apt_updated=0
apt_install() {  # PACKAGE... (only those not installed yet)
  local need=() pkg
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg"); done
  [ "${#need[@]}" -gt 0 ] || return 0
  echo "installing system packages: ${need[*]}"
  if [ "$apt_updated" = 0 ]; then apt-get update -qq >/dev/null; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
}

# System libraries Qt needs even offscreen, and Xvfb + a tray host for screenshots.
if can_apt_install; then
  apt_install libegl1 libgl1 libxkbcommon0 libxkbcommon-x11-0 libfontconfig1 libdbus-1-3 \
              libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 libxcb-shape0 libxcb-xinerama0 \
              libxcb-randr0 libxcb-render-util0 libxcb-image0 xvfb \
              $( [ "$WITH_TEST" = 1 ] && echo desktop-file-utils systemd chromium )
  # The GPU's build tools, and for the tests the Vulkan ones plus lavapipe
  # (mesa-vulkan-drivers): a failure here costs the GPU build, not the install.
  extra="$BACKEND_APT"
  [ "$WITH_TEST" = 0 ] || extra+=" $VULKAN_APT_PACKAGES"
  if [ -n "${extra// }" ] && ! apt_install $(tr ' ' '\n' <<<"$extra" | sort -u); then
    echo "install.sh: installing $extra failed" >&2
  fi
fi

# A GPU build that turns out impossible: an automatic choice still ends with a
# working CPU install; one asked for by name stops here.
fall_back_to_cpu() {  # WHY
  if [ "$REQUESTED" != auto ]; then
    echo "install.sh: --backend $REQUESTED: $1" >&2
    exit 1
  fi
  BACKEND=cpu BACKEND_FLAGS=""
  BACKEND_REASON="$1"
  echo "backend: cpu: $1" >&2
}

if [ "$BACKEND" = vulkan ] && [ -n "$BACKEND_FLAGS" ]; then
  missing=$(vulkan_tools_missing)
  if [ -n "$missing" ]; then
    fall_back_to_cpu "the Vulkan build tools are still missing ($missing); to use the GPU: $(vulkan_install_command) && bash packaging/install.sh"
  else
    headers_error=$(mktemp)
    if include_dir=$(resolve_vulkan_include_dir 2>"$headers_error"); then
      [ "$include_dir" = "$(system_vulkan_include_dir)" ] || BACKEND_FLAGS+=" -DVulkan_INCLUDE_DIR=$include_dir"
    else
      fall_back_to_cpu "no usable Vulkan headers: $(tr '\n' ' ' <"$headers_error")"
    fi
    rm -f "$headers_error"
  fi
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true

# The CUDA toolkit the build uses: the system's, or NVIDIA's wheels fetched
# into the cache. The built CUDA module finds cuBLAS there at run time (the
# build records the folder it linked from), so nobody sets LD_LIBRARY_PATH.
if [ "$BACKEND" = cuda ] && [ -n "$BACKEND_FLAGS" ]; then
  cuda_root=""
  if [ "${CUDA_TOOLKIT:-}" = wheels ]; then
    echo "fetching CUDA $CUDA_WHEELS_VERSION from NVIDIA's PyPI wheels into $TRAY_APP_CACHE/cuda-toolkit (about 600 MB to download the first time)"
    if cuda_root=$(fetch_cuda_wheels .venv/bin/python); then
      BACKEND_FLAGS+=" -DCUDAToolkit_ROOT=$cuda_root -DCMAKE_CUDA_COMPILER=$cuda_root/bin/nvcc"
    else
      fall_back_to_cpu "the CUDA toolkit could not be fetched (above)"
    fi
  else
    cuda_root=$(cuda_toolkit_root "$(find_nvcc)")
  fi
  if [ "$BACKEND" = cuda ]; then
    # ggml's CUDA module finds cuBLAS where it was linked from: llama-cpp-python
    # gives its libraries only $ORIGIN, so the module's own link adds the folder.
    cublas_dir=$(cuda_library_dir "$cuda_root")
    [ -z "$cublas_dir" ] || BACKEND_FLAGS+=" -DCMAKE_MODULE_LINKER_FLAGS=-Wl,-rpath,$cublas_dir"
    libcuda=$(libcuda_for_linking "$cuda_root")
    if [ -z "$libcuda" ]; then
      BACKEND_FLAGS+=" -DGGML_CUDA_NO_VMM=ON"
    elif [ "$CUDA_TOOLKIT" = wheels ]; then
      BACKEND_FLAGS+=" -DCUDA_cuda_driver_LIBRARY=$libcuda"
    fi
  fi
fi

# The wheelhouse for the current BACKEND and flags, built if missing; sets
# `wheelhouse` and `key`.
build_wheelhouse() {
  local build_log
  key=$(wheelhouse_key "$LLAMA_VERSION" "$LLAMA_CMAKE_ARGS" "$SERVER_FLAGS" "$BACKEND" "$BACKEND_FLAGS")
  wheelhouse="$TRAY_APP_CACHE/wheels/$key"
  ! ls "$wheelhouse"/llama_cpp_python-*.whl >/dev/null 2>&1 || return 0
  local took="about 6 minutes on 2 cores"
  [ "$BACKEND" != cuda ] || took=$CUDA_BUILD_TIME
  echo "building llama-cpp-python $LLAMA_VERSION and llama-server for $BACKEND ($(echo $LLAMA_CMAKE_ARGS $BACKEND_FLAGS)); $took"
  mkdir -p "$wheelhouse"
  build_log="$wheelhouse/build.log"
  if ! CMAKE_ARGS="$LLAMA_CMAKE_ARGS $BACKEND_FLAGS $SERVER_FLAGS" .venv/bin/python -m pip wheel --no-cache-dir --no-deps \
       "llama-cpp-python==$LLAMA_VERSION" -w "$wheelhouse" >"$build_log" 2>&1; then
    tail -n 40 "$build_log" >&2
    echo "install.sh: building llama-cpp-python for $BACKEND failed; the whole log is $build_log" >&2
    return 1
  fi
  # What it was built with, for whoever reuses it (benchmarks/gpu_check/prepare.py).
  echo "$LLAMA_CMAKE_ARGS $BACKEND_FLAGS $SERVER_FLAGS" > "$wheelhouse/cmake-args"
}

if ! build_wheelhouse; then
  # A GPU toolchain can fail in ways detection can't see (an nvcc too old for
  # the compiler, a driver without headers).
  [ -n "$BACKEND_FLAGS" ] || exit 1
  fall_back_to_cpu "the $BACKEND build failed (log above); building for the CPU instead"
  build_wheelhouse || exit 1
fi
installed=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('llama_cpp_python'))" 2>/dev/null || true)
stamp=.venv/.llama-build-key
if [ "$installed" != "$LLAMA_VERSION" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$key" ]; then
  .venv/bin/python -m pip install -q --force-reinstall --no-deps "$wheelhouse"/llama_cpp_python-*.whl 2>&1 | grep -v '^WARNING: Location' || true
  echo "$key" > "$stamp"
fi

extra=""
[ "$WITH_TEST" = 1 ] && extra="[test]"
.venv/bin/python -m pip install -q -e ".$extra" 2>&1 | grep -v '^WARNING: Location' || true

if [ "$WITH_TEST" = 1 ]; then
  # The agent CLIs the compatibility suite runs (tests/integration/test_compat_agent_clis.py),
  # at the versions it tested, from the npm registry into the venv. Never fails the
  # install: without npm those tests skip, naming it.
  if command -v npm >/dev/null 2>&1; then
    npm install --prefix .venv/npm --no-audit --no-fund --silent \
      @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0 >/dev/null 2>&1 \
      || echo "install.sh: npm could not install the agent CLIs; their tests will skip" >&2
  fi
  # LlamaIndex in a venv of its own: llama-index-llms-openai needs openai<3, which
  # the frameworks in the main venv don't take. Never fails the install: without
  # it its test skips, naming it.
  { [ -x .venv/llamaindex/bin/python ] || "$PYTHON" -m venv .venv/llamaindex; } \
    && .venv/llamaindex/bin/python -m pip install -q llama-index-core==0.14.25 \
         llama-index-llms-openai==0.8.3 llama-index-llms-openai-like==0.8.1 >.venv/llamaindex.log 2>&1 \
    || echo "install.sh: could not install LlamaIndex (.venv/llamaindex.log); its test will skip" >&2
  # Never fails the install: without it the Vulkan tests skip with the reason
  # it writes beside the venv.
  LLAMA_VERSION="$LLAMA_VERSION" LLAMA_CMAKE_ARGS="$LLAMA_CMAKE_ARGS" SERVER_FLAGS="$SERVER_FLAGS" \
    bash packaging/build-vulkan-server.sh .venv || echo "install.sh: the Vulkan test build stopped early (exit $?)" >&2
fi

.venv/bin/python -c "
import llama_cpp, tray_app
from tray_app.core.engine.runtime import bundled_llama_server
from tray_app.core.memory.telemetry import detect_gpu_offload_support
# Not llama_supports_gpu_offload() alone: it is also true for the RPC backend.
print('llama-cpp-python', llama_cpp.__version__, '| GPU offload:', detect_gpu_offload_support().supported,
      '| llama-server:', bundled_llama_server() or 'missing')"
server="" libraries=""
{ read -r server; read -r libraries; } < <(.venv/bin/python -c "
from tray_app.core.engine.runtime import bundled_llama_server, library_dirs
server = bundled_llama_server()
print(server or '')
print(':'.join(str(d) for d in library_dirs(server)) if server else '')") || true
devices=$(LD_LIBRARY_PATH="$libraries" llama_server_devices "$server")
# llama.cpp lists no CPU-type Vulkan device (Mesa's llvmpipe), so "none" on a
# Vulkan build means the card has no Vulkan driver.
[ "$BACKEND/$devices" != vulkan/none ] || devices+=" (no Vulkan driver for the GPU; Debian: mesa-vulkan-drivers, NVIDIA: its driver)"
[ "$BACKEND/$devices" != cuda/none ] \
  || devices+=" (no CUDA device visible: the NVIDIA driver or its libcuda.so.1 is missing or does not match; nvidia-smi checks it. llama-server serves on the CPU until it is fixed)"
echo "backend built: $BACKEND; llama.cpp sees: $devices"
