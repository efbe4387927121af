"""Every training method keeps the contract: 1 and 2 processes end with the same parameters."""

from __future__ import annotations

import json

import pytest

from accord.observe.metrics import read_metrics
from conftest import assert_ok, final_params, max_param_diff, recipe_for, run_accord, write_recipe

pytestmark = pytest.mark.distributed
TOLERANCE = 1e-5

CASES = {
    "pretrain": ("pretrain", {}),
    "classify": ("classify", {}),
    # A non-sigmoid mixture with the NLL term: every dpo.loss_type is a per-pair sum like this one.
    "dpo": ("dpo", {"dpo": {"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0, 0.5], "rpo_alpha": 0.2}}),
    "chat-sft-lora": ("chat", {"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def runs(request, tmp_path_factory):
    task, sections = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    recipe = write_recipe(root / "recipe.yaml", recipe_for(task, root, **sections))
    outs = {}
    for world in (1, 2):
        out = root / f"world{world}"
        proc = run_accord("train", recipe, f"engine.processes={world}", "train.log_every=1", f"output.dir={out}")
        assert_ok(proc)
        outs[world] = out
    return request.param, outs, proc


def test_one_and_two_processes_end_with_the_same_parameters(runs):
    name, outs, _ = runs
    diff = max_param_diff(final_params(outs[1]), final_params(outs[2]))
    print(f"{name}: max |Δparam| 1 vs 2 processes = {diff:.2e}")
    assert diff <= TOLERANCE


def test_the_task_logs_its_metrics(runs):
    name, outs, proc = runs
    records = read_metrics(outs[2])
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 10 and all(r["loss"] is not None for r in train)
    evals = [r for r in records if r["kind"] == "eval"]
    if name == "classify":
        assert {"accuracy", "macro_f1"} <= set(evals[-1])
        assert "accuracy" in train[-1]
    if name == "dpo":
        assert {"reward_accuracy", "reward_margin", "reward_chosen", "reward_rejected"} <= set(train[-1])
        assert "reward accuracy" in proc.stdout + proc.stderr
    if name == "chat-sft-lora":
        assert "k trained)" in proc.stderr  # only the adapters train


def test_lora_export_is_merged_and_loads_without_peft(runs):
    name, outs, _ = runs
    if name != "chat-sft-lora":
        pytest.skip("LoRA case only")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(outs[2] / "final")
    assert not any("lora" in n for n, _ in model.named_parameters())
    adapter = json.loads((outs[2] / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4


# Run in a fresh process from another folder: peft resolves the adapter's base from the
# current folder, so a relative or vanished base path would fail here.
_LOAD_ADAPTER = """
import json, sys, torch
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
out = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(out + "/adapter")
ids = tokenizer(["2+3=5", "10+1=11"], return_tensors="pt", padding=True)
with torch.no_grad():
    merged = AutoModelForCausalLM.from_pretrained(out + "/final")(**ids).logits
    auto = AutoPeftModelForCausalLM.from_pretrained(out + "/adapter")(**ids).logits
    named = json.load(open(out + "/adapter/adapter_config.json"))["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(named)
    plain = PeftModel.from_pretrained(base, out + "/adapter")(**ids).logits
print((auto - merged).abs().max().item(), (plain - merged).abs().max().item())
"""


def test_the_lora_adapter_loads_with_peft_alone_from_any_folder(runs, tmp_path):
    """adapter/ is peft's layout naming a base that loads from any current folder (a model
    built from model.config: the run's base/, by absolute path); AutoPeftModelForCausalLM and
    PeftModel.from_pretrained on it give the merged final/ model's logits."""
    name, outs, _ = runs
    if name != "chat-sft-lora":
        pytest.skip("LoRA case only")
    import subprocess
    import sys

    from conftest import accord_env

    config = json.loads((outs[2] / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((outs[2] / "base").resolve())
    assert f"base_model: {outs[2].resolve() / 'base'}" in (outs[2] / "adapter" / "README.md").read_text()
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_ADAPTER, str(outs[2])],
        cwd=tmp_path,
        env=accord_env() | {"HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    auto, plain = map(float, proc.stdout.split())
    print(f"max |Δlogit| vs merged final/: AutoPeftModelForCausalLM {auto:.1e}, PeftModel {plain:.1e}")
    assert auto <= 1e-5 and plain <= 1e-5


def test_dpo_with_precomputed_reference_matches_the_live_reference(runs, tmp_path):
    name, outs, _ = runs
    if name != "dpo":
        pytest.skip("DPO case only")
    recipe = outs[2].parent / "recipe.yaml"  # the 2-process run above used the live reference
    out = tmp_path / "precomputed"
    proc = run_accord("train", recipe, "dpo.precompute_reference=true", "train.log_every=1", f"output.dir={out}")
    assert_ok(proc)
    assert "reference log-probabilities precomputed" in proc.stderr
    diff = max_param_diff(final_params(outs[2]), final_params(out))
    print(f"dpo: max |Δparam| live vs precomputed reference = {diff:.2e}")
    assert diff <= TOLERANCE


def test_lora_under_a_sharded_strategy_exports_the_same_merged_model(runs, tmp_path):
    name, outs, _ = runs
    if name != "chat-sft-lora":
        pytest.skip("LoRA case only")
    recipe = outs[2].parent / "recipe.yaml"
    out = tmp_path / "fsdp"
    assert_ok(run_accord("train", recipe, "engine.strategy=fsdp", f"output.dir={out}"))
    assert max_param_diff(final_params(outs[2]), final_params(out)) <= TOLERANCE
    assert (out / "adapter" / "adapter_config.json").is_file()


@pytest.mark.slow  # two more 2-process DPO runs
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_dpo_reference_sharded_like_the_policy_matches_ddp(runs, tmp_path, strategy):
    """Under fsdp/zero3 the frozen reference is built on the meta device and sharded like the
    policy (no whole copy on any rank); the run ends where the DDP run does."""
    import importlib.util

    name, outs, _ = runs
    if name != "dpo":
        pytest.skip("DPO case only")
    if strategy == "zero3" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed")
    out = tmp_path / strategy
    assert_ok(
        run_accord(
            "train",
            outs[2].parent / "recipe.yaml",
            f"engine.strategy={strategy}",
            "train.log_every=1",
            f"output.dir={out}",
        )
    )
    diff = max_param_diff(final_params(outs[2]), final_params(out))
    print(f"dpo: max |Δparam| {strategy} vs ddp = {diff:.2e}")
    assert diff <= TOLERANCE
