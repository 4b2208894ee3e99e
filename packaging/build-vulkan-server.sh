#!/usr/bin/env bash
# The tests' Vulkan llama-server: llama.cpp's real Vulkan backend, run there
# on Mesa's software Vulkan device (lavapipe, Debian's mesa-vulkan-drivers).
#   bash packaging/build-vulkan-server.sh [VENV]   # install.sh --test runs it
#
# Built from the llama.cpp that the llama-cpp-python sdist vendors (the same
# source as the app's own build), llama-server and its shared libraries, with
# -DGGML_VULKAN=ON, into its own cache folder keyed by version, flags and
# Vulkan headers: cold about 6 minutes on 2 cores, then a copy.
#
# What the tests read, beside the venv (exactly one of the two exists):
#   VENV/.vulkan-llama-server       the binary's absolute path; it has listed a
#                                   Vulkan device with GGML_VK_VISIBLE_DEVICES=0
#   VENV/.vulkan-llama-server.skip  one line: why there is none
# It never fails the install: every way out that isn't a binary is a reason.
# TRAY_APP_VULKAN_TESTS=0 turns it off.
set -uo pipefail
cd "$(dirname "$0")/.."
source packaging/backend.sh

venv=$(cd "${1:-.venv}" && pwd) || exit 1
record="$venv/.vulkan-llama-server"
skip_file="$record.skip"
LLAMA_VERSION="${LLAMA_VERSION:?set by install.sh}"
LLAMA_CMAKE_ARGS="${LLAMA_CMAKE_ARGS:-}"
SERVER_FLAGS="${SERVER_FLAGS:-}"
rm -f "$record" "$skip_file"

skip_with() {
  echo "$1" > "$skip_file"
  echo "Vulkan tests will skip: $1" >&2
  exit 0
}

[ "${TRAY_APP_VULKAN_TESTS:-1}" != 0 ] || skip_with "TRAY_APP_VULKAN_TESTS=0 turned the Vulkan llama-server off"
missing=$(vulkan_tools_missing)
[ -z "$missing" ] || skip_with "the Vulkan build tools are missing ($missing); to build it: $(vulkan_install_command)"
headers_error=$(mktemp)
include_dir=$(resolve_vulkan_include_dir 2>"$headers_error") \
  || skip_with "no usable Vulkan headers: $(tr '\n' ' ' <"$headers_error")"
rm -f "$headers_error"

# Release: a bare CMake build is unoptimised. Shared, with an $ORIGIN RUNPATH:
# the folder (llama-server and its libllama/libggml*) can be copied as a
# whole, and the router test loads that Vulkan libllama in the router itself,
# to show that the router opens no GPU even with a GPU-capable llama.cpp.
flags="-DCMAKE_BUILD_TYPE=Release $LLAMA_CMAKE_ARGS $SERVER_FLAGS -DGGML_VULKAN=ON -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON -DVulkan_INCLUDE_DIR=$include_dir"
key=$(printf '%s\n' "$LLAMA_VERSION" "$flags" "$(vulkan_header_version "$include_dir")" "$(glslc --version 2>&1 | head -n1)" \
  | sha256sum | cut -c1-12)
cache="$TRAY_APP_CACHE/vulkan-llama-server/$key"
binary="$cache/llama-server"

if [ -f "$cache/failed" ]; then
  skip_with "the Vulkan build failed before ($(cat "$cache/failed")); delete $cache to try again"
fi
if [ ! -x "$binary" ]; then
  mkdir -p "$cache" "$TRAY_APP_CACHE/sdist"
  sdist="$TRAY_APP_CACHE/sdist/llama_cpp_python-$LLAMA_VERSION.tar.gz"
  if [ ! -f "$sdist" ]; then
    download=$(mktemp -d)
    "$venv/bin/python" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_VERSION" -d "$download" \
      >"$cache/download.log" 2>&1 && mv "$download"/llama_cpp_python-*.tar.gz "$sdist"
    rm -rf "$download"
    # Not recorded as failed: a download fails for reasons the next run may not have.
    [ -f "$sdist" ] || skip_with "downloading the llama-cpp-python $LLAMA_VERSION sdist failed: $(tail -n 2 "$cache/download.log" | tr '\n' ' ')"
  fi
  echo "building the tests' Vulkan llama-server (llama.cpp of llama-cpp-python $LLAMA_VERSION, -DGGML_VULKAN=ON); about 6 minutes on 2 cores"
  work=$(mktemp -d)
  started=$(date +%s)
  generator=()
  command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
  # shellcheck disable=SC2086 # flags is a list of words
  if tar -xzf "$sdist" -C "$work" --strip-components=2 "llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp" \
     && cmake -S "$work/llama.cpp" -B "$work/build" "${generator[@]}" $flags >"$cache/build.log" 2>&1 \
     && cmake --build "$work/build" --target llama-server -j "$(nproc)" >>"$cache/build.log" 2>&1 \
     && mkdir -p "$cache/partial" && cp -P "$work/build/bin/"lib*.so* "$cache/partial/" \
     && cp "$work/build/bin/llama-server" "$cache/partial/llama-server" \
     && cp -P "$cache/partial/"* "$cache/" && rm -rf "$cache/partial" && [ -x "$binary" ]; then
    echo "$(( $(date +%s) - started ))" > "$cache/build-seconds"
    echo "built the Vulkan llama-server in $(cat "$cache/build-seconds") s"
  else
    tail -n 20 "$cache/build.log" >&2
    # The compiler's own complaint says more than CMake's summary of it.
    first_error=$(grep -m1 -E 'error:' "$cache/build.log" || grep -m1 'CMake Error' "$cache/build.log" || tail -n 1 "$cache/build.log")
    echo "the build stopped: ${first_error#"${first_error%%[![:space:]]*}"}; log $cache/build.log" > "$cache/failed"
  fi
  rm -rf "$work"
  [ -x "$binary" ] || skip_with "the Vulkan build failed: $(cat "$cache/failed")"
fi

# A copy in the venv, so the tests don't depend on the cache staying: the
# libraries first, the binary last, so a binary there has its libraries.
mkdir -p "$venv/vulkan/bin"
rm -f "$venv/vulkan/bin/llama-server"
cp -P "$cache/"lib*.so* "$venv/vulkan/bin/"
cp "$binary" "$venv/vulkan/bin/llama-server.partial" && mv "$venv/vulkan/bin/llama-server.partial" "$venv/vulkan/bin/llama-server"
# llama.cpp hides CPU-type Vulkan devices (lavapipe is one) unless asked by index.
devices=$(GGML_VK_VISIBLE_DEVICES=0 llama_server_devices "$venv/vulkan/bin/llama-server")
case "$devices" in
  Vulkan*) ;;
  *) skip_with "the Vulkan llama-server lists no Vulkan device ($devices); lavapipe is Debian's mesa-vulkan-drivers" ;;
esac
echo "$venv/vulkan/bin/llama-server" > "$record"
echo "Vulkan llama-server for the tests: $venv/vulkan/bin/llama-server ($devices)"
