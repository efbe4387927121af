#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv.
# Idempotent: a second run only reinstalls when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
PIP=("$VENV/bin/python" -m pip install --quiet)

# torch first: without CUDA take the CPU build (a bare "torch" requirement would pull a
# multi-GB CUDA build). Machines with CUDA keep whatever torch the user installs.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "${PIP[@]}" torch
    else
        "${PIP[@]}" torch==2.13.0
    fi
fi

stamp="$VENV/.accord-installed"
want=$(cat pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    "${PIP[@]}" -e ".[dev]"
    echo "$want" > "$stamp"
fi
