"""accelerate at the edges: its launch environment is honoured, contradictions are errors,
and `accord config` writes the config that reproduces `accord train`."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from accord.launch.accelerate_config import accelerate_config, accelerate_settings, reconcile
from accord.recipe.schema import RecipeError, validate_recipe
from conftest import TINY_RECIPE, assert_ok, final_params, max_param_diff, run_accord, write_recipe

BASE_ENV = {"ACCELERATE_MIXED_PRECISION": "no"}


def test_outside_accelerate_there_is_nothing_to_honour():
    assert accelerate_settings({}) == {}


def test_one_process_of_a_config_asking_for_several_is_refused():
    """accelerate sets MASTER_ADDR for several processes or machines and RANK in each process
    it starts; MULTI_CPU (or use_cpu) starts one without RANK, which would train alone."""
    alone = BASE_ENV | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "ACCELERATE_USE_CPU": "True"}
    with pytest.raises(RecipeError, match="accelerate launch started one process although its config asks for"):
        accelerate_settings(alone)
    assert accelerate_settings(alone | {"RANK": "0", "WORLD_SIZE": "2"})["engine.strategy"] == "ddp"


def test_deepspeed_environment_maps_to_the_zero_strategy():
    env = BASE_ENV | {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2",
        "ACCELERATE_GRADIENT_CLIPPING": "1.0",
    }
    assert accelerate_settings(env) == {
        "engine.precision": "no",
        "engine.strategy": "zero3",
        "engine.offload": "optimizer",
        "batch.grad_accum": 2,
        "optim.max_grad_norm": 1.0,
    }


def test_a_users_deepspeed_json_is_read(tmp_path):
    ds = {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}},
        "train_micro_batch_size_per_gpu": "auto",
        "bf16": {"enabled": True},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    settings = accelerate_settings(
        BASE_ENV | {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path)}
    )
    assert settings["engine.strategy"] == "zero2" and settings["engine.precision"] == "bf16"
    assert "batch.micro_batch_size" not in settings  # "auto" is accord's to decide


def test_fsdp_environment_maps_to_fsdp():
    env = BASE_ENV | {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_ACTIVATION_CHECKPOINTING": "true",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
    }
    assert accelerate_settings(env) == {
        "engine.precision": "no",
        "engine.strategy": "fsdp",
        "engine.activation_checkpointing": True,
        "engine.fsdp_layer_class": "LlamaDecoderLayer",
    }


def test_settings_fill_what_the_recipe_leaves_open():
    recipe = validate_recipe({k: v for k, v in TINY_RECIPE.items() if k != "engine"})
    merged = reconcile(
        recipe, {"engine.strategy": "zero2", "engine.precision": "no", "batch.grad_accum": 2}, world_size=2
    )
    assert merged.engine.strategy == "zero2"


def test_a_contradiction_names_both_values():
    recipe = validate_recipe(TINY_RECIPE)  # says engine.strategy: ddp
    with pytest.raises(
        RecipeError, match=r"accelerate config has engine.strategy='zero2' but the recipe has engine.strategy='ddp'"
    ):
        reconcile(recipe, {"engine.strategy": "zero2"}, world_size=2)


def test_an_accumulation_mismatch_says_what_would_agree():
    recipe = validate_recipe(TINY_RECIPE)  # 32 global, micro 8: 2 processes -> accumulation 2
    with pytest.raises(
        RecipeError, match=r"gradient_accumulation_steps=4 but the recipe gives 2 .* set batch.micro_batch_size=4"
    ):
        reconcile(recipe, {"batch.grad_accum": 4}, world_size=2)


def test_accord_config_describes_each_strategy():
    recipe = validate_recipe(TINY_RECIPE)
    ddp = accelerate_config(recipe, 2)
    assert (ddp["distributed_type"], ddp["num_processes"], ddp["use_cpu"]) == ("MULTI_GPU", 2, False)
    zero = accelerate_config(
        validate_recipe(
            TINY_RECIPE | {"engine": TINY_RECIPE["engine"] | {"strategy": "zero3", "offload": "optimizer"}}
        ),
        2,
    )
    assert (zero["distributed_type"], zero["deepspeed_config"]["zero_stage"]) == ("DEEPSPEED", 3)
    assert (
        zero["deepspeed_config"]["gradient_accumulation_steps"] == 2
        and zero["deepspeed_config"]["offload_optimizer_device"] == "cpu"
    )
    fsdp = accelerate_config(validate_recipe(TINY_RECIPE | {"engine": TINY_RECIPE["engine"] | {"strategy": "fsdp"}}), 2)
    assert fsdp["distributed_type"] == "FSDP" and fsdp["fsdp_config"]["fsdp_version"] == 2
    multi = accelerate_config(recipe, 4, num_machines=2, main_process_ip="10.0.0.1")
    assert (multi["num_machines"], multi["main_process_ip"]) == (2, "10.0.0.1")


def _launch_environment(config_file) -> dict[str, str]:
    """The environment `accelerate launch --config_file FILE` gives its workers: accelerate's
    own launch_command parses the file and picks the launcher; only the final start of the
    processes is replaced by keeping the environment that launcher prepared."""
    from unittest import mock

    import accelerate.commands.launch as launch
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    env: dict[str, str] = {}
    with (
        mock.patch.object(launch, "deepspeed_launcher", lambda args: env.update(prepare_deepspeed_cmd_env(args)[1])),
        mock.patch.object(launch, "multi_gpu_launcher", lambda args: env.update(prepare_multi_gpu_env(args))),
        mock.patch.object(launch, "simple_launcher", lambda args: env.update(prepare_simple_launcher_cmd_env(args)[1])),
    ):
        launch.launch_command(
            launch.launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
        )
    return env


@pytest.mark.parametrize(
    "engine",
    [
        {"strategy": "ddp"},
        {"strategy": "zero3", "offload": "optimizer"},
        {"strategy": "zero2", "precision": "bf16"},
        {"strategy": "fsdp", "activation_checkpointing": True},
    ],
    ids=lambda e: "-".join(str(v) for v in e.values()),
)
def test_accord_config_round_trips_through_accelerate(tmp_path, engine):
    """`accord config` writes a file; what accelerate launch makes of it, read back by accord's
    settings reader, is the recipe's engine (and its accumulation and clipping)."""
    from accord.distributed.batch_plan import BatchPlan
    from accord.launch.accelerate_config import write_accelerate_config

    pytest.importorskip("accelerate")
    recipe = validate_recipe(
        TINY_RECIPE | {"engine": TINY_RECIPE["engine"] | engine, "optim": TINY_RECIPE["optim"] | {"max_grad_norm": 0.5}}
    )
    path = tmp_path / "accelerate.yaml"
    write_accelerate_config(accelerate_config(recipe, 2), path)
    settings = accelerate_settings(_launch_environment(path))
    assert settings["engine.strategy"] == recipe.engine.strategy
    assert settings["engine.precision"] == recipe.engine.precision
    if recipe.engine.strategy.startswith("zero"):
        assert settings["engine.offload"] == recipe.engine.offload
        assert settings["batch.grad_accum"] == BatchPlan.derive(32, 8, 2).grad_accum == 2
        assert settings["optim.max_grad_norm"] == 0.5
    if recipe.engine.strategy == "fsdp":
        assert settings["engine.activation_checkpointing"] is True
    # A recipe that leaves the engine open, launched with that file, becomes the original one.
    open_recipe = validate_recipe(
        {k: v for k, v in TINY_RECIPE.items() if k != "engine"}
        | {"optim": TINY_RECIPE["optim"] | {"max_grad_norm": 0.5}}
    )
    merged = reconcile(open_recipe, settings, world_size=2)
    assert merged.engine.model_dump() | {"device": "cpu"} == recipe.engine.model_dump() | {"device": "cpu"}
    assert merged.optim == recipe.optim and merged.batch == recipe.batch


@pytest.mark.distributed
def test_accelerate_launch_of_accord_config_equals_accord_train(tmp_path, tiny_reference):
    pytest.importorskip("accelerate")
    recipe, direct = tiny_reference
    config = tmp_path / "accelerate.yaml"
    assert_ok(run_accord("config", recipe, "--out", config, timeout=60))
    assert yaml.safe_load(config.read_text())["distributed_type"] == "MULTI_GPU"
    launched = tmp_path / "launched"
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    proc = run_accord("train", recipe, f"output.dir={launched}", launcher=accelerate)
    assert_ok(proc)
    assert (proc.stdout + proc.stderr).count("accord: batch 2 processes") == 1
    assert max_param_diff(final_params(direct), final_params(launched)) <= 1e-5


@pytest.mark.distributed  # accelerate launch starts 2 processes (each stops at the check)
def test_a_launch_config_that_contradicts_the_recipe_stops_before_training(tmp_path):
    recipe = write_recipe(tmp_path / "tiny.yaml", TINY_RECIPE)
    config = tmp_path / "zero2.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "compute_environment": "LOCAL_MACHINE",
                "distributed_type": "DEEPSPEED",
                "mixed_precision": "no",
                "num_machines": 1,
                "num_processes": 2,
                "machine_rank": 0,
                "use_cpu": False,
                "deepspeed_config": {
                    "zero_stage": 2,
                    "gradient_accumulation_steps": 1,
                    "offload_optimizer_device": "none",
                    "offload_param_device": "none",
                },
            }
        )
    )
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    proc = run_accord("train", recipe, f"output.dir={tmp_path / 'o'}", launcher=accelerate, timeout=180)
    assert proc.returncode != 0
    assert (
        "accord: error: accelerate config has engine.strategy='zero2' but the recipe has engine.strategy='ddp'"
        in proc.stderr
    )
    assert "accord: batch" not in proc.stderr  # nothing trained


@pytest.mark.subprocess  # accelerate launch starts one accord, which refuses before any work
def test_a_multi_cpu_config_is_refused_in_one_line_instead_of_training_alone(tmp_path):
    recipe = write_recipe(tmp_path / "tiny.yaml", TINY_RECIPE)
    config = tmp_path / "multi_cpu.yaml"
    multi_cpu = {"distributed_type": "MULTI_CPU", "num_machines": 2, "num_processes": 4, "machine_rank": 0}
    multi_cpu |= {"main_process_ip": "127.0.0.1", "main_process_port": 29555, "mixed_precision": "no"}
    config.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", **multi_cpu, "use_cpu": True}))
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    proc = run_accord("train", recipe, f"output.dir={tmp_path / 'o'}", launcher=accelerate, timeout=180)
    # accelerate launch then raises, repeating the child's stderr in its own traceback.
    assert proc.returncode != 0
    assert "accord: error: accelerate launch started one process although its config asks" in proc.stderr
    assert "accord: warning" not in proc.stderr
    assert not (tmp_path / "o").exists()


def _trl_style_config(distributed_type: str, **section) -> dict:
    """The field set of TRL's examples/accelerate_configs, with num_processes and
    mixed_precision adjusted to a 2-core CPU machine."""
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": distributed_type,
        "downcast_bf16": "no",
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": "no",
        "num_machines": 1,
        "num_processes": 2,
        "rdzv_backend": "static",
        "same_network": True,
        "tpu_env": [],
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
        "use_cpu": False,
    }
    return config | section


TRL_CONFIGS = {
    "multi_gpu": _trl_style_config("MULTI_GPU", gpu_ids="all"),
    "fsdp2": _trl_style_config(
        "FSDP",
        fsdp_config={
            "fsdp_activation_checkpointing": False,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_offload_params": False,
            "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_version": 2,
        },
    ),
    "deepspeed_zero2": _trl_style_config(
        "DEEPSPEED",
        deepspeed_config={
            "deepspeed_multinode_launcher": "standard",
            "gradient_accumulation_steps": 2,
            "offload_optimizer_device": "none",
            "offload_param_device": "none",
            "zero3_init_flag": False,
            "zero_stage": 2,
        },
    ),
}


# slow (the default tier keeps cheaper equivalents): multi_gpu is the launch of
# test_accelerate_launch_of_accord_config_equals_accord_train (a MULTI_GPU config under
# accelerate launch, equal to accord train); fsdp2's config is read as engine.strategy=fsdp by
# test_accord_config_round_trips_through_accelerate[fsdp-True], and fsdp's updates equal DDP's in
# test_strategies. deepspeed_zero2 stays: the recipe filled in by a launch config, end to end.
@pytest.mark.distributed
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n != "deepspeed_zero2" else []) for n in sorted(TRL_CONFIGS)]
)
def test_trl_example_configs_run_the_same_training(name, tmp_path, tiny_reference):
    """A recipe that leaves the strategy open, launched with a user's accelerate config,
    trains under what the config says and ends where the DDP run ends."""
    if name.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    _, reference = tiny_reference
    open_recipe = {k: v for k, v in TINY_RECIPE.items() if k != "engine"} | {
        "engine": {"device": "cpu"}
    }  # strategy etc. left open
    recipe = write_recipe(tmp_path / "open.yaml", open_recipe)
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(TRL_CONFIGS[name]))
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    out = tmp_path / "out"
    proc = run_accord("train", recipe, f"output.dir={out}", launcher=accelerate)
    assert_ok(proc)
    expected = {"multi_gpu": "ddp", "fsdp2": "fsdp", "deepspeed_zero2": "zero2"}[name]
    assert f", {expected} on cpu" in proc.stderr
    assert max_param_diff(final_params(reference), final_params(out)) <= 1e-5


def test_a_users_deepspeed_json_fills_in_and_conflicts_are_named(tmp_path):
    from accord.launch.accelerate_config import deepspeed_file_settings

    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 3},
                "gradient_accumulation_steps": 2,
                "gradient_clipping": 1.0,
                "train_micro_batch_size_per_gpu": "auto",
            }
        )
    )
    open_recipe = validate_recipe(
        {k: v for k, v in TINY_RECIPE.items() if k != "engine"} | {"engine": {"deepspeed_config": str(path)}}
    )
    merged = reconcile(open_recipe, deepspeed_file_settings(str(path)), world_size=2, source=str(path))
    assert merged.engine.strategy == "zero3"
    with pytest.raises(
        RecipeError, match=r"ds.json has engine.strategy='zero3' but the recipe has engine.strategy='ddp'"
    ):
        reconcile(validate_recipe(TINY_RECIPE), deepspeed_file_settings(str(path)), world_size=2, source=str(path))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(RecipeError, match="is not valid JSON"):
        deepspeed_file_settings(str(tmp_path / "bad.json"))
    # The same file given through `accelerate launch` is read by the same checks.
    from accord.launch.accelerate_config import accelerate_settings

    env = {
        "ACCELERATE_MIXED_PRECISION": "no",
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(tmp_path / "gone.json"),
    }
    with pytest.raises(RecipeError, match="accelerate config: deepspeed_config_file: file not found"):
        accelerate_settings(env)


# ---------------------------------------------------------------- what accord does not run (yet)

# The shapes of TRL's examples/accelerate_configs files: context parallelism on FSDP2, and
# ALST/Ulysses sequence parallelism on DeepSpeed (its current cp_backend form and the
# earlier sp_size form).
TRL_LONG_CONTEXT_CONFIGS = {
    "context_parallel_2gpu": _trl_style_config("FSDP", mixed_precision="bf16")
    | {
        "fsdp_config": {
            "fsdp_activation_checkpointing": False,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_offload_params": False,
            "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_version": 2,
        },
        "parallelism_config": {
            "parallelism_config_dp_replicate_size": 1,
            "parallelism_config_dp_shard_size": 1,
            "parallelism_config_tp_size": 1,
            "parallelism_config_cp_size": 2,
        },
    },
    "alst_ulysses_4gpu": _trl_style_config("DEEPSPEED", mixed_precision="bf16", num_processes=4)
    | {
        "deepspeed_config": {
            "zero_stage": 3,
            "offload_optimizer_device": "none",
            "offload_param_device": "none",
            "zero3_init_flag": False,
        },
        "parallelism_config": {
            "parallelism_config_dp_replicate_size": 1,
            "parallelism_config_dp_shard_size": 2,
            "parallelism_config_tp_size": 1,
            "parallelism_config_cp_size": 2,
            "parallelism_config_cp_backend": "deepspeed",
        },
    },
    "alst_ulysses_4gpu_sp_size": _trl_style_config("DEEPSPEED", mixed_precision="bf16", num_processes=4)
    | {
        "deepspeed_config": {
            "zero_stage": 3,
            "offload_optimizer_device": "none",
            "offload_param_device": "none",
            "zero3_init_flag": False,
        },
        "parallelism_config": {
            "parallelism_config_dp_replicate_size": 1,
            "parallelism_config_dp_shard_size": 2,
            "parallelism_config_tp_size": 1,
            "parallelism_config_sp_size": 2,
            "parallelism_config_sp_backend": "deepspeed",
        },
    },
}


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "context_parallel_2gpu",
            r"^accelerate config: parallelism_config_cp_size=2 asks for context parallelism \(torch backend\), "
            r"which accord does not support yet; set it to 1",
        ),
        (
            "alst_ulysses_4gpu",
            r"^accelerate config: parallelism_config_cp_size=2 asks for context parallelism \(deepspeed backend\), "
            r"which accord does not support yet",
        ),
    ],
)
def test_trl_long_context_configs_are_refused_naming_the_key(tmp_path, name, message):
    """Launched with TRL's long-context accelerate configs, accord does not silently train
    with the parallelism dropped: one line names the key."""
    pytest.importorskip("accelerate")
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(TRL_LONG_CONTEXT_CONFIGS[name]))
    with pytest.raises(RecipeError, match=message) as refused:
        accelerate_settings(_launch_environment(path))
    assert "\n" not in str(refused.value)


def test_trl_ulysses_sp_size_config_becomes_engine_sequence_parallel_and_accord_config_writes_it_back(tmp_path):
    """TRL's alst_ulysses form (sp_size 2, sp_backend deepspeed, dp_shard 2, zero3 on 4
    processes) is engine.sequence_parallel=2; `accord config` writes the same form back."""
    pytest.importorskip("accelerate")
    path = tmp_path / "alst.yaml"
    path.write_text(yaml.safe_dump(TRL_LONG_CONTEXT_CONFIGS["alst_ulysses_4gpu_sp_size"]))
    settings = accelerate_settings(_launch_environment(path))
    assert settings["engine.sequence_parallel"] == 2 and settings["engine.strategy"] == "zero3"
    recipe = validate_recipe({k: v for k, v in TINY_RECIPE.items() if k != "engine"})
    merged = reconcile(recipe, dict(settings), world_size=4)
    assert (merged.engine.sequence_parallel, merged.engine.strategy) == (2, "zero3")
    with pytest.raises(
        RecipeError,
        match=r"data-parallel size of 2 \(parallelism_config\) but accord runs 2 processes, "
        r"1 data-parallel groups of 2",
    ):
        reconcile(recipe, dict(settings), world_size=2)
    with pytest.raises(
        RecipeError, match=r"has engine.sequence_parallel=2 but the recipe has engine.sequence_parallel=4"
    ):
        reconcile(validate_recipe(TINY_RECIPE | {"engine": {"sequence_parallel": 4}}), dict(settings), world_size=4)
    from accord.launch.accelerate_config import accelerate_config

    written = accelerate_config(merged, num_processes=4)
    assert written["parallelism_config"]["parallelism_config_sp_size"] == 2
    assert written["parallelism_config"]["parallelism_config_dp_shard_size"] == 2
    (tmp_path / "written.yaml").write_text(yaml.safe_dump(written))
    assert accelerate_settings(_launch_environment(tmp_path / "written.yaml"))["engine.sequence_parallel"] == 2


def test_data_parallel_sizes_are_accepted_when_they_are_the_world():
    env = BASE_ENV | {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1",
        "PARALLELISM_CONFIG_CP_SIZE": "1",
    }
    recipe = validate_recipe({k: v for k, v in TINY_RECIPE.items() if k != "engine"})
    assert reconcile(recipe, accelerate_settings(env), world_size=2).engine.strategy == "fsdp"
    with pytest.raises(
        RecipeError, match=r"data-parallel size of 2 \(parallelism_config\) but accord runs 4 processes"
    ):
        reconcile(recipe, accelerate_settings(env), world_size=4)
    hybrid = env | {"PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2"}
    with pytest.raises(
        RecipeError,
        match=r"parallelism_config_dp_replicate_size=2 with parallelism_config_dp_shard_size=2 "
        r"asks for hybrid sharding",
    ):
        accelerate_settings(hybrid)


def test_fsdp_version_1_is_run_as_fsdp2_and_says_so(tmp_path):
    pytest.importorskip("accelerate")
    from accord.launch.accelerate_config import accelerate_warnings

    config = _trl_style_config(
        "FSDP",
        fsdp_config={
            "fsdp_version": 1,
            "fsdp_sharding_strategy": "SHARD_GRAD_OP",
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        },
    )
    path = tmp_path / "fsdp1.yaml"
    path.write_text(yaml.safe_dump(config))
    env = _launch_environment(path)
    assert accelerate_settings(env)["engine.strategy"] == "fsdp"
    (warning,) = accelerate_warnings(env)
    assert warning.startswith("accelerate config has fsdp_version: 1, but accord runs FSDP2")
    assert "fsdp_sharding_strategy SHARD_GRAD_OP is not applied" in warning
    assert accelerate_warnings(env | {"FSDP_VERSION": "2"}) == []
