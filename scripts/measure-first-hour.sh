#!/usr/bin/env bash
# The new user's first hour, timed step by step on a fresh clone, as the README tells it:
# clone -> setup -> quickstart -> generate from final/ -> report -> plan -> an override run ->
# resume with more steps. Prints one row per step: wall time and time to the first output
# (the first line on stdout or stderr). Run it on an otherwise idle machine; it leaves
# nothing behind but what pip caches.
#
#   ./scripts/measure-first-hour.sh            # clones this checkout's HEAD into a temp folder
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d -t accord-first-hour-XXXXXX)"
trap 'rm -rf "$work"' EXIT
rows=()

# step NAME COMMAND...: run it in the clone, time it, keep its output in $work/step-K.log
step() {
    local name="$1"; shift
    local clone="$work/accord"
    [ -d "$clone" ] || clone="$work"
    local times log="$work/step-${#rows[@]}.log"
    times="$(cd "$clone" && python3 - "$log" "$@" <<'PY'
import subprocess, sys, time, selectors
log, command = sys.argv[1], sys.argv[2:]
start = time.perf_counter()
proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
first = None
with open(log, "wb") as out:
    for line in proc.stdout:
        if first is None and line.strip():
            first = time.perf_counter() - start
        out.write(line)
code = proc.wait()
print(f"{time.perf_counter() - start:.1f} {first if first is not None else float('nan'):.1f} {code}")
PY
)"
    read -r wall first code <<<"$times"
    rows+=("$(printf '| %-34s | %7s s | %7s s | %s |' "$name" "$wall" "$first" "$code")")
    if [ "$code" != 0 ]; then
        echo "measure-first-hour: step '$name' failed (exit $code):" >&2
        tail -20 "$log" >&2
        exit 1
    fi
}

echo "measure-first-hour: fresh clone in $work (setup ~1-2 min, the quickstart ~1-2 min, the rest ~2 min)…" >&2
load_before="$(cut -d' ' -f1 /proc/loadavg)"
step "git clone" git clone -q "$repo" "$work/accord"
step "./scripts/setup.sh" ./scripts/setup.sh
step "accord train quickstart --overwrite" .venv/bin/accord train recipes/quickstart.yaml --overwrite
step "generate from final/ (README lines)" .venv/bin/python -c '
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer, model = AutoTokenizer.from_pretrained("runs/quickstart/final"), AutoModelForCausalLM.from_pretrained("runs/quickstart/final")
print(tokenizer.decode(model.generate(**tokenizer("57+8=", return_tensors="pt"), max_new_tokens=4, do_sample=False)[0], skip_special_tokens=True))'
step "accord report runs/quickstart" .venv/bin/accord report runs/quickstart
step "accord plan recipes/quickstart.yaml" .venv/bin/accord plan recipes/quickstart.yaml
step "accord train ... (overrides, 50 steps)" .venv/bin/accord train recipes/quickstart.yaml batch.micro_batch_size=8 optim.lr=1e-3 train.max_steps=50 output.dir=runs/mine
step "accord train ... --resume (to 80 steps)" .venv/bin/accord train recipes/quickstart.yaml batch.micro_batch_size=8 optim.lr=1e-3 train.max_steps=80 output.dir=runs/mine --resume

echo "Measured $(date -u +%F) on $(nproc) cores (load average $load_before before, $(cut -d' ' -f1 /proc/loadavg) after)"
echo
echo "| step | wall | first output | exit |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
echo
echo "generate from final/ printed: $(tail -1 "$work/step-3.log")"
