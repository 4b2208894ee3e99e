#!/usr/bin/env bash
# Installs tray-app into ./.venv on a fresh Linux machine.
#   bash packaging/install.sh          # the app
#   bash packaging/install.sh --test   # the app plus what the test suite needs
#
# llama-cpp-python ships as source only. We build it once into a wheelhouse
# keyed by its version and build flags, because pip's own wheel cache ignores
# CMAKE_ARGS and would hand back a build made for other flags.
# The same build also makes llama.cpp's own llama-server (the default engine)
# from the llama.cpp that llama-cpp-python vendors: one compile of ggml and
# llama for both, the same tokenizer and chat template on every path. The
# wheel then carries bin/llama-server and its libraries in lib/, in llama.cpp's
# install layout; runtime.bundled_llama_server() finds it there.
# About 6 minutes on 2 cores the first time; cached after that.
# The default CPU flags are portable x86-64 (AVX2); `-march=native` builds have
# crashed with SIGILL on VMs that advertise AMX/AVX-512 but do not allow it.
# For an NVIDIA GPU: LLAMA_CMAKE_ARGS="-DGGML_CUDA=on" bash packaging/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."

WITH_TEST=0
[ "${1:-}" = "--test" ] && WITH_TEST=1

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

# System libraries Qt needs even offscreen, and Xvfb + a tray host for screenshots.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  need=()
  for pkg in libegl1 libgl1 libxkbcommon0 libxkbcommon-x11-0 libfontconfig1 libdbus-1-3 \
             libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 libxcb-shape0 libxcb-xinerama0 \
             libxcb-randr0 libxcb-render-util0 libxcb-image0 xvfb \
             $( [ "$WITH_TEST" = 1 ] && echo desktop-file-utils systemd ); do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
  done
  if [ "${#need[@]}" -gt 0 ]; then
    echo "installing system packages: ${need[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true

key=$(printf '%s %s %s' "$LLAMA_VERSION" "$LLAMA_CMAKE_ARGS" "$SERVER_FLAGS" | sha256sum | cut -c1-12)
wheelhouse="${XDG_CACHE_HOME:-$HOME/.cache}/tray-app/wheels/$key"
if ! ls "$wheelhouse"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "building llama-cpp-python $LLAMA_VERSION and llama-server ($LLAMA_CMAKE_ARGS); about 6 minutes on 2 cores"
  mkdir -p "$wheelhouse"
  build_log="$wheelhouse/build.log"
  if ! CMAKE_ARGS="$LLAMA_CMAKE_ARGS $SERVER_FLAGS" .venv/bin/python -m pip wheel --no-cache-dir --no-deps \
       "llama-cpp-python==$LLAMA_VERSION" -w "$wheelhouse" >"$build_log" 2>&1; then
    tail -n 40 "$build_log" >&2
    echo "install.sh: building llama-cpp-python failed; the whole log is $build_log" >&2
    exit 1
  fi
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
.venv/bin/python -c "
import llama_cpp, tray_app
from tray_app.core.engine.runtime import bundled_llama_server
from tray_app.core.memory.telemetry import detect_gpu_offload_support
# Not llama_supports_gpu_offload() alone: it is also true for the RPC backend.
print('llama-cpp-python', llama_cpp.__version__, '| GPU offload:', detect_gpu_offload_support().supported,
      '| llama-server:', bundled_llama_server() or 'missing')"
