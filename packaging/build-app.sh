#!/usr/bin/env bash
# Builds a standalone app folder, dist/tray-app/, with PyInstaller:
#   bash packaging/install.sh && bash packaging/build-app.sh
#   dist/tray-app/run.sh            # the tray;  dist/tray-app/run.sh serve  headless
# The folder runs without Python or the virtualenv; copy or move it anywhere.
# It holds the llama.cpp build that install.sh made (CPU, or CUDA with
# LLAMA_CMAKE_ARGS="-DGGML_CUDA=on"), so build on the kind of machine it is for.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
if [ ! -x "$PYTHON" ]; then
  echo "build-app: $PYTHON not found: run 'bash packaging/install.sh' first" >&2
  exit 1
fi
if ! "$PYTHON" -m PyInstaller --version >/dev/null 2>&1; then
  "$PYTHON" -m pip install -q "pyinstaller>=6.10" 2>&1 | grep -v '^WARNING: Location' || true
fi

"$PYTHON" -m PyInstaller --noconfirm --clean --log-level WARN \
  --distpath dist --workpath build/pyinstaller packaging/pyinstaller/tray-app.spec

app=dist/tray-app
install -m 755 packaging/pyinstaller/run.sh "$app/run.sh"
# The desktop entry and the systemd unit, for installing the folder by hand.
install -m 644 packaging/tray-app.desktop packaging/tray-app.service "$app/"

# Smoke test: the frozen CLI parses, and finds the bundled model.
"$app/run.sh" serve --help >/dev/null
"$app/run.sh" models --url http://127.0.0.1:9 >/dev/null
# ...and its llama-server loads its libraries from where runtime.library_dirs looks.
server="$app/_internal/llama_server/llama-server"
if [ -x "$server" ]; then
  LD_LIBRARY_PATH="$app/_internal/llama_server:$app/_internal/llama_cpp/lib:$app/_internal" "$server" --version >/dev/null 2>&1 \
    || { echo "build-app: the bundled llama-server does not start" >&2; exit 1; }
fi
echo "built $app ($(du -sh "$app" | cut -f1)); start it with $app/run.sh"
