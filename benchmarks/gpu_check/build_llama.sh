#!/usr/bin/env bash
# Builds llama-server and libllama from the trimmed llama.cpp source that
# prepare.py packs, as shared libraries (llama-cpp-python's bindings load
# libllama from the same build through LLAMA_CPP_LIB_PATH).
#
#   build_llama.sh SOURCE_DIR BUILD_DIR [extra cmake flags...]
#
# On the GPU machine: build_llama.sh src build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90
# Here (CPU only) the same command without the CUDA flags checks that the
# trimmed source still builds.
set -euo pipefail
src=$1 build=$2
shift 2
# The same switches packaging/install.sh gives llama-cpp-python's build:
# llama-server, no web UI, no network fetches, no tests or examples.
cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DGGML_NATIVE=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  "$@" >"$build.configure.log" 2>&1 || { tail -40 "$build.configure.log"; exit 1; }
# Only the two targets the check needs (and what they link), not every tool.
cmake --build "$build" --target llama-server llama -j "$(nproc)" >"$build.build.log" 2>&1 \
  || { tail -60 "$build.build.log"; exit 1; }
ls -la "$build/bin/llama-server"
