"""Sharded strategies behind the one Engine interface: FSDP2, DeepSpeed ZeRO-1/2/3 (with
CPU offload) and torch's ZeroRedundancyOptimizer give the DDP run's updates, write
checkpoints that any strategy resumes on any number of processes, and export a model that
plain transformers loads. Activation checkpointing changes memory, not results."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

from accord.distributed.batch_plan import BatchPlan
from accord.recipe.schema import RecipeError, validate_recipe
from conftest import TINY_RECIPE, assert_ok, final_params, max_param_diff, run_accord, step_losses, write_recipe

TOLERANCE = 1e-5
STEPS = TINY_RECIPE["train"]["max_steps"]
MID = STEPS // 2  # every run also writes a checkpoint here, for the resume tests

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (pip install deepspeed)")

# name -> recipe overrides; every run: TINY_RECIPE (fp32), 2 processes × 8 × 2 accumulation steps
RUNS = {
    "ddp": ["engine.strategy=ddp"],
    "fsdp": ["engine.strategy=fsdp"],
    "zero1": ["engine.strategy=zero1", "engine.zero1_implementation=deepspeed"],
    "zero1-torch": ["engine.strategy=zero1", "engine.zero1_implementation=torch"],
    "zero2": ["engine.strategy=zero2"],
    "zero3": ["engine.strategy=zero3"],
    "zero2-offload": ["engine.strategy=zero2", "engine.offload=optimizer"],
    "zero3-offload": ["engine.strategy=zero3", "engine.offload=optimizer+params"],
    "ddp-ac": ["engine.strategy=ddp", "engine.activation_checkpointing=true"],
    "fsdp-ac": ["engine.strategy=fsdp", "engine.activation_checkpointing=true"],
    "zero3-ac": ["engine.strategy=zero3", "engine.activation_checkpointing=true"],
    # the long-row levers together: checkpoints kept in host memory and MLPs over 3 sequence tiles
    "ddp-long": ["engine.strategy=ddp", "engine.activation_checkpointing=offload", "engine.tiled_mlp=3"],
    "fsdp-long": ["engine.strategy=fsdp", "engine.activation_checkpointing=offload", "engine.tiled_mlp=3"],
    "zero3-long": ["engine.strategy=zero3", "engine.activation_checkpointing=offload", "engine.tiled_mlp=3"],
    "zero3-lora": ["engine.strategy=zero3", "lora.r=4"],
}
DEEPSPEED_RUNS = {"zero1", "zero2", "zero3", "zero2-offload", "zero3-offload", "zero3-ac", "zero3-long", "zero3-lora"}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return write_recipe(tmp_path_factory.mktemp("strategies") / "tiny.yaml", TINY_RECIPE)


@pytest.fixture(scope="module")
def run(recipe, tiny_reference):
    """Each named run happens once per module, when a test first asks for it (so the runs
    of deselected slow tests cost nothing); the ddp run is the session's reference run."""
    done: dict[str, tuple[Path, str]] = {"ddp": (tiny_reference[1], "")}

    def get(name: str) -> tuple[Path, str]:
        if name not in done:
            out = recipe.parent / name
            proc = run_accord("train", recipe, f"checkpoint.every_steps={MID}", f"output.dir={out}", *RUNS[name])
            assert_ok(proc)
            done[name] = (out, proc.stdout + proc.stderr)
        return done[name]

    return get


def _compare(reference: Path, out: Path, label: str) -> None:
    diff = max_param_diff(final_params(reference), final_params(out))
    ref_losses, losses = step_losses(reference), step_losses(out)
    assert sorted(losses) == sorted(ref_losses) == list(range(1, STEPS + 1))
    loss_diff = max(abs(ref_losses[s] - losses[s]) for s in ref_losses)
    print(f"max |Δparam| {label}: {diff:.2e}; max |Δloss| {loss_diff:.2e}")
    assert diff <= TOLERANCE, f"{label}: {diff}"
    assert loss_diff <= TOLERANCE, f"{label}: {loss_diff}"


def _strategy_params(names: list[str], slow: set[str] = frozenset()) -> list:
    params = []
    for name in names:
        marks = [needs_deepspeed] if name in DEEPSPEED_RUNS else []
        if name in slow:
            marks.append(pytest.mark.slow)
        params.append(pytest.param(name, marks=marks, id=name))
    return params


# ---------------------------------------------------------------- same updates as DDP


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name",
    _strategy_params(
        ["fsdp", "zero1", "zero2", "zero3", "zero1-torch", "zero2-offload", "zero3-offload"],
        slow={"zero2-offload", "zero3-offload"},
    ),
)
def test_strategy_matches_ddp_and_exports_a_loadable_model(run, name):
    reference, _ = run("ddp")
    out, output = run(name)
    _compare(reference, out, f"ddp vs {name}")
    if name == "zero1-torch":
        assert output.count("zero1 uses torch's ZeroRedundancyOptimizer") == 1  # said once, by rank 0

    # The final model (gathered from the shards) loads in plain transformers, whole and in fp32.
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
    loaded = {k: v for k, v in model.state_dict().items() if k in final_params(reference)}
    assert loaded.keys() == final_params(reference).keys()
    assert max_param_diff(final_params(reference), loaded) <= TOLERANCE
    assert model.config.architectures == ["LlamaForCausalLM"]


# ---------------------------------------------------------------- resume across strategies and world sizes


@pytest.mark.distributed
@pytest.mark.parametrize(
    "written_by, processes, resumed_with",
    [
        pytest.param("fsdp", 1, "ddp", id="fsdp-2-to-ddp-1"),
        pytest.param("zero2", 1, "ddp", marks=needs_deepspeed, id="zero2-2-to-ddp-1"),
        pytest.param("zero2", 1, "fsdp", marks=needs_deepspeed, id="zero2-2-to-fsdp-1"),
        pytest.param("zero1-torch", 1, "fsdp", marks=pytest.mark.slow, id="zero1torch-2-to-fsdp-1"),
        pytest.param("fsdp", 2, "zero1-torch", marks=pytest.mark.slow, id="fsdp-2-to-zero1torch-2"),
        pytest.param("zero2", 2, "zero2", marks=[needs_deepspeed, pytest.mark.slow], id="zero2-2-to-zero2-2"),
        pytest.param("ddp", 2, "zero3", marks=[needs_deepspeed, pytest.mark.slow], id="ddp-2-to-zero3-2"),
        pytest.param("zero3", 1, "fsdp", marks=[needs_deepspeed, pytest.mark.slow], id="zero3-2-to-fsdp-1"),
        pytest.param("fsdp", 1, "zero3", marks=[needs_deepspeed, pytest.mark.slow], id="fsdp-2-to-zero3-1"),
        pytest.param(
            "zero3-offload",
            1,
            "zero3-offload",
            marks=[needs_deepspeed, pytest.mark.slow],
            id="zero3offload-2-to-zero3offload-1",
        ),
    ],
)
def test_checkpoint_resumes_under_another_strategy_and_world_size(
    run, recipe, tmp_path, written_by, processes, resumed_with
):
    reference, _ = run("ddp")
    source, _ = run(written_by)
    checkpoint = source / "checkpoints" / f"step-{MID:06d}"
    out = tmp_path / "resumed"
    proc = run_accord(
        "train",
        recipe,
        *RUNS[resumed_with],
        f"engine.processes={processes}",
        f"resume={checkpoint}",
        f"output.dir={out}",
    )
    assert_ok(proc)
    assert f"resumed from {checkpoint} at step {MID} " in proc.stderr
    _compare_resumed(reference, out, f"{written_by}×2 -> {resumed_with}×{processes} vs uninterrupted ddp")


def _compare_resumed(reference: Path, out: Path, label: str) -> None:
    """A run resumed at MID ends with the reference's parameters and step losses."""
    diff = max_param_diff(final_params(reference), final_params(out))
    resumed, original = step_losses(out), step_losses(reference)
    assert sorted(resumed) == list(range(MID + 1, STEPS + 1))
    loss_diff = max(abs(resumed[s] - original[s]) for s in resumed)
    print(f"max |Δparam| {label}: {diff:.2e}; max |Δloss| {loss_diff:.2e}")
    assert diff <= TOLERANCE and loss_diff <= TOLERANCE


@pytest.mark.distributed
@pytest.mark.parametrize("name", _strategy_params(["fsdp", "zero2"]))
def test_checkpoint_is_written_by_every_rank_keyed_by_name(run, name):
    """One DCP file per rank, each holding part of the state (no rank gathers it all), and an
    index of every parameter's weights and AdamW moments by name, whatever the strategy."""
    from accord.engine.state import stored_keys

    out, _ = run(name)
    folder = out / "checkpoints" / f"step-{MID:06d}"
    shards = sorted((folder / "state").glob("*.distcp"))
    assert [p.name for p in shards] == ["__0_0.distcp", "__1_0.distcp"]
    sizes = [p.stat().st_size for p in shards]
    assert min(sizes) > 0.25 * sum(sizes), sizes  # both ranks write a real share
    assert not (folder / "model.safetensors").exists() and not (folder / "optimizer.pt").exists()
    keys = stored_keys(folder)
    weights = final_params(out)
    assert {k.removeprefix("model.") for k in keys if k.startswith("model.")} == set(weights)
    for param, value in weights.items():
        assert keys[f"model.{param}"][0] == value.shape
        assert {f"optim.{param}.{k}" for k in ("exp_avg", "exp_avg_sq", "step")} <= set(keys)


@pytest.mark.distributed
@pytest.mark.slow
@needs_deepspeed
def test_resume_chain_fsdp4_zero3_2_ddp1_matches_the_uninterrupted_run(run, recipe, tmp_path):
    """fsdp on 4 processes -> zero3 on 2 -> ddp on 1, each resuming the previous one's
    checkpoint, ends with the uninterrupted run's parameters and losses (fp32, ≤1e-5)."""
    reference, _ = run("ddp")
    first, second, third = tmp_path / "fsdp4", tmp_path / "zero3-2", tmp_path / "ddp1"
    assert_ok(
        run_accord(
            "train",
            recipe,
            "engine.strategy=fsdp",
            "engine.processes=4",
            "checkpoint.every_steps=3",
            "checkpoint.keep_last=4",
            f"output.dir={first}",
        )
    )
    assert_ok(
        run_accord(
            "train",
            recipe,
            "engine.strategy=zero3",
            "engine.processes=2",
            "checkpoint.every_steps=3",
            "checkpoint.keep_last=4",
            f"resume={first / 'checkpoints' / 'step-000003'}",
            f"output.dir={second}",
        )
    )
    proc = run_accord(
        "train",
        recipe,
        "engine.strategy=ddp",
        "engine.processes=1",
        f"resume={second / 'checkpoints' / 'step-000006'}",
        f"output.dir={third}",
    )
    assert_ok(proc)
    assert "at step 6 " in proc.stdout + proc.stderr
    ref_losses = step_losses(reference)
    for out, steps in ((first, range(1, STEPS + 1)), (second, range(4, STEPS + 1)), (third, range(7, STEPS + 1))):
        losses = step_losses(out)
        assert sorted(losses) == list(steps)
        loss_diff = max(abs(losses[s] - ref_losses[s]) for s in losses)
        diff = max_param_diff(final_params(reference), final_params(out))
        print(f"{out.name}: max |Δparam| vs uninterrupted ddp-2 {diff:.2e}; max |Δloss| {loss_diff:.2e}")
        assert diff <= TOLERANCE and loss_diff <= TOLERANCE


@pytest.mark.distributed
@pytest.mark.slow
@needs_deepspeed
def test_a_zero3_lora_run_checkpoints_after_evaluating_and_resumes_on_one_process(run, recipe, tmp_path):
    """The frozen (LoRA base) weights are gathered whole for the final checkpoint although the
    evaluation before it left some gathered or in flight (GatheredParameters refused those),
    and a 1-process zero3 run resumed from the middle checkpoint, each rank reading its
    partitions, ends with the uninterrupted run's parameters and losses."""
    whole, _ = run("zero3-lora")
    assert (whole / "checkpoints" / f"step-{STEPS:06d}").is_dir()
    out = tmp_path / "resumed"
    assert_ok(
        run_accord(
            "train",
            recipe,
            *RUNS["zero3-lora"],
            "engine.processes=1",
            f"resume={whole / 'checkpoints' / f'step-{MID:06d}'}",
            f"output.dir={out}",
        )
    )
    _compare_resumed(whole, out, "zero3 LoRA×2 -> ×1 vs uninterrupted")


# ---------------------------------------------------------------- activation checkpointing


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", _strategy_params(["fsdp", "ddp", "zero3"], slow={"ddp", "zero3"}))
def test_activation_checkpointing_gives_the_same_parameters(run, strategy):
    off, _ = run(strategy)
    on, _ = run(f"{strategy}-ac")
    _compare(off, on, f"{strategy} activation checkpointing on vs off")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", _strategy_params(["ddp", "fsdp", "zero3"]))
def test_offloaded_checkpointing_with_tiled_mlp_gives_the_same_parameters(run, strategy):
    off, _ = run(strategy)
    on, _ = run(f"{strategy}-long")
    _compare(off, on, f"{strategy} offloaded checkpointing + tiled MLP vs neither")


SAVED_TENSORS = """
import copy, json, sys, torch
from conftest import TINY_RECIPE
from accord.distributed.batch_plan import BatchPlan
from accord.distributed.group import DistInfo
from accord.engine import build_engine
from accord.engine.spec import EngineSpec
from accord.models.build import build_model, build_tokenizer
from accord.recipe.schema import validate_recipe

counts = {}
for strategy in sys.argv[1:]:
    for ac in (False, True):
        raw = copy.deepcopy(TINY_RECIPE)
        raw["engine"] |= {"strategy": strategy, "activation_checkpointing": ac, "processes": 1}
        recipe = validate_recipe(raw)
        model = build_model(recipe.model, build_tokenizer(recipe.model), 0)
        plan = BatchPlan.derive(8, 8, 1)
        engine = build_engine(EngineSpec.of(recipe), model, DistInfo(), torch.device("cpu"), plan, 10)
        engine.module.train()
        saved = []
        with (
            engine.sync_context(True),
            torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t),
        ):
            loss = engine.train_model(input_ids=torch.randint(0, 200, (2, 12))).logits.float().sum()
        engine.backward(loss, 1)
        engine.step()
        engine.close()
        counts[f"{strategy} {'on' if ac else 'off'}"] = len(saved)
print(json.dumps(counts))
"""


@pytest.mark.distributed  # trains a step of each strategy's engine in a child process
def test_activation_checkpointing_is_really_on():
    """The equality above would also hold if checkpointing were silently off: count the
    tensors the forward keeps for backward (one process per strategy, through the engine)."""
    import json
    import sys

    from conftest import REPO, accord_env, run_process

    strategies = ["ddp", "fsdp"] + (["zero3"] if HAS_DEEPSPEED else [])
    proc = run_process(
        [sys.executable, "-c", SAVED_TENSORS, *strategies],
        cwd=REPO / "tests",
        env=accord_env() | {"DS_ACCELERATOR": "cpu"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"tensors saved for backward: {counts}")
    for strategy in strategies:
        assert counts[f"{strategy} on"] < counts[f"{strategy} off"] / 3, counts


# ---------------------------------------------------------------- recipe rules and the derived DeepSpeed config


def _recipe(**engine) -> dict:
    raw = copy.deepcopy(TINY_RECIPE)
    raw["engine"] |= engine
    return raw


@pytest.mark.parametrize(
    "engine, message",
    [
        ({"strategy": "ddp", "offload": "optimizer"}, "engine.offload=optimizer needs a DeepSpeed strategy"),
        ({"strategy": "fsdp", "offload": "optimizer+params"}, "needs a DeepSpeed strategy"),
        (
            {"strategy": "zero2", "offload": "optimizer+params"},
            "engine.offload=optimizer+params needs engine.strategy=zero3",
        ),
        ({"strategy": "zero1", "zero1_implementation": "torch", "offload": "optimizer"}, "cannot offload"),
        ({"strategy": "zero4"}, "engine.strategy"),
    ],
)
def test_impossible_engine_combinations_are_one_line_recipe_errors(engine, message):
    with pytest.raises(RecipeError) as error:
        validate_recipe(_recipe(**engine))
    assert message in str(error.value) and "\n" not in str(error.value)


@needs_deepspeed
def test_fp16_with_deepspeed_on_the_cpu_is_refused():
    from accord.launch.preflight import check_environment

    [problem] = check_environment(validate_recipe(_recipe(strategy="zero2", precision="fp16", device="cpu")))
    assert "DeepSpeed has no fp16 on the CPU" in problem
    assert (
        check_environment(validate_recipe(_recipe(strategy="fsdp", precision="fp16", device="cpu"))) == []
    )  # FSDP2 + GradScaler runs there


def test_without_deepspeed_zero2_names_the_install_and_zero1_falls_back(monkeypatch):
    from accord.launch.preflight import check_environment

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name == "deepspeed" else real(name, *a, **k)
    )
    for strategy in ("zero2", "zero3"):
        [problem] = check_environment(
            validate_recipe(_recipe(strategy=strategy))
        )  # the recipe itself is valid anywhere
        assert "needs DeepSpeed, which is not installed: pip install deepspeed" in problem
    assert check_environment(validate_recipe(_recipe(strategy="zero1"))) == []  # torch's ZeroRedundancyOptimizer then
    from accord.engine import deepspeed_available

    assert not deepspeed_available()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_config_is_derived_from_the_recipe(stage):
    """Every value DeepSpeed reads comes from the recipe (non-default ones here, so a
    hard-coded or "auto" value would show) and the batch plan."""
    import torch

    from accord.engine.deepspeed.engine import deepspeed_config
    from accord.engine.spec import EngineSpec
    from accord.models.build import build_model, build_tokenizer

    offload = {1: "none", 2: "optimizer", 3: "optimizer+params"}[stage]
    optim = {"lr": 1e-3, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1, "max_grad_norm": 0.5}
    recipe = validate_recipe(_recipe(strategy=f"zero{stage}", offload=offload, precision="bf16") | {"optim": optim})
    model = build_model(recipe.model, build_tokenizer(recipe.model), 0)
    plan = BatchPlan.derive(32, 4, 2)
    config = deepspeed_config(EngineSpec.of(recipe), plan, torch.device("cpu"), model)
    assert (
        config["train_batch_size"],
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
    ) == (32, 4, 4)
    assert config["gradient_clipping"] == 0.5
    # bf16 is accord's autocast over fp32 weights under every strategy, not DeepSpeed's bf16 mode.
    assert config["bf16"] == {"enabled": False} and config["fp16"]["enabled"] is False
    assert config["communication_data_type"] == "fp32"  # gradients reduced in fp32, as under DDP/FSDP
    assert config["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 1e-3, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1, "torch_adam": True},
    }
    zero = config["zero_optimization"]
    assert zero["stage"] == stage
    assert zero.get("offload_optimizer") == ({"device": "cpu", "pin_memory": False} if stage >= 2 else None)
    assert zero.get("offload_param") == ({"device": "cpu", "pin_memory": False} if stage == 3 else None)
    width = TINY_RECIPE["model"]["config"]["hidden_size"]
    assert zero["reduce_bucket_size"] == width * width  # buckets sized to the model, not DeepSpeed's 5e8 elements
    if stage == 3:  # small tensors (norms) stay whole: 10 × the model's hidden size
        assert zero["stage3_param_persistence_threshold"] == 10 * width
        assert zero["stage3_prefetch_bucket_size"] == int(0.9 * width * width)
        # DeepSpeed's 1e9-element defaults would keep the whole gathered model on every rank:
        # reuse, prefetch and optimizer sub-groups are bounded by one decoder layer instead.
        layer = sum(p.numel() for p in model.model.layers[0].parameters())
        assert (zero["stage3_max_reuse_distance"], zero["stage3_max_live_parameters"], zero["sub_group_size"]) == (
            layer,
            2 * layer,
            layer,
        )
        assert (
            deepspeed_config(EngineSpec.of(recipe), plan, torch.device("cpu"), model, world=4)["zero_optimization"][
                "sub_group_size"
            ]
            == layer // 4
        )
    else:
        assert "stage3_max_reuse_distance" not in zero and "sub_group_size" not in zero
    fp32 = deepspeed_config(
        EngineSpec.of(validate_recipe(_recipe(strategy=f"zero{stage}", offload=offload))),
        plan,
        torch.device("cpu"),
        model,
    )
    assert (
        fp32["bf16"] == {"enabled": False}
        and fp32["fp16"]["enabled"] is False
        and "communication_data_type" not in fp32
    )
    assert (
        fp32["gradient_clipping"] == TINY_RECIPE["optim"]["max_grad_norm"]
        and fp32["optimizer"]["params"]["lr"] == TINY_RECIPE["optim"]["lr"]
    )


# ---------------------------------------------------------------- accord plan vs the real tensors


@pytest.mark.distributed
@pytest.mark.parametrize("name", _strategy_params(["ddp", "fsdp", "zero1", "zero2", "zero3"]))
def test_plan_model_state_equals_the_bytes_each_rank_holds(run, name):
    """`accord plan`'s parameter, optimizer-state and master-weight bytes per rank are the
    bytes of the tensors the run really held (the largest rank's, after step 1)."""
    from accord.observe.metrics import read_metrics
    from accord.planner.estimate import meta_model, model_state

    out, _ = run(name)
    held = next(r for r in read_metrics(out) if r["kind"] == "model_state")
    recipe = validate_recipe(TINY_RECIPE)
    planned = model_state(meta_model(recipe), name, world=2, precision="no", offload="none")
    for part in ("params", "optimizer", "master"):
        assert planned[part] == held[f"{part}_bytes"], (
            f"{name} {part}: planned {planned[part]}, held {held[f'{part}_bytes']}"
        )


def test_plan_of_a_saved_model_folder_equals_the_plan_of_its_config(tmp_path):
    from accord.models.build import build_model, build_tokenizer
    from accord.planner.estimate import meta_model, model_state

    recipe = validate_recipe(TINY_RECIPE)
    tokenizer = build_tokenizer(recipe.model)
    model = build_model(recipe.model, tokenizer, seed=0)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    saved = validate_recipe(TINY_RECIPE | {"model": {"path": str(tmp_path / "model")}})
    for name in ("ddp", "zero3"):
        assert model_state(meta_model(saved), name, 2, "no", "none") == model_state(
            meta_model(recipe), name, 2, "no", "none"
        )


def test_plan_cli_recommends_and_refuses(tiny_recipe):
    import json

    from conftest import run_accord_here

    proc = run_accord_here("plan", tiny_recipe, "--gpus", "2", "--gpu-memory", "1GB", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [r["strategy"] for r in data["strategies"]] == ["ddp", "zero1", "zero2", "zero3", "fsdp"]
    assert data["advice"].startswith("recommended: engine.strategy=ddp with batch.micro_batch_size=16")
    tight = run_accord_here("plan", tiny_recipe, "--gpus", "2", "--gpu-memory", "0.0001GB")
    assert tight.returncode == 0 and "nothing fits in" in tight.stdout
    on_cpu = run_accord_here("plan", tiny_recipe)  # no GPU here: the recipe's CPU processes
    assert on_cpu.returncode == 0 and "unless engine.release_host_memory=true" in on_cpu.stdout
    bad = run_accord_here("plan", tiny_recipe, "--gpus", "3", "--gpu-memory", "1GB")
    assert bad.returncode == 2 and "cannot be split over 3 processes" in bad.stderr
