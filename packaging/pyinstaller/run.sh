#!/bin/sh
# Starts the app from this folder: ./run.sh (tray), ./run.sh serve (headless),
# ./run.sh models, ./run.sh --help. Works through a symlink, e.g.
#   ln -s "$PWD/run.sh" ~/.local/bin/tray-app
here=$(dirname "$(readlink -f "$0")")
exec "$here/tray-app" "$@"
