"""User mistakes: one clear line each, a non-zero exit, no traceback, before any worker starts.

Most run the command's main() in this process (run_accord_here: no Python start and imports
per case); a few run the real `accord` command, one per kind of refusal: the launcher's own
(test_missing_recipe_file) and the checks the first of 2 workers makes before the others pass
their gate (test_malformed_data_row_names_file_and_line)."""

import pytest

from conftest import run_accord, run_accord_here

# Cases checked by the first worker on 2 processes run here on 1 process: the launcher is then
# the worker and makes the same checks (accord.launch.preflight) before anything starts.
HERE = "engine.processes=1"


def assert_clean_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("accord: error: ")]
    assert errors, proc.stderr
    for needle in needles:
        assert any(needle in line for line in errors), proc.stderr
    # Nothing was started: no worker announced itself.
    assert "accord: batch" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "override, needle",
    [
        # found by the launcher, on the recipe's 2 processes
        ("batch.micro_batch_sise=4", "unknown key batch.micro_batch_sise; did you mean batch.micro_batch_size?"),
        ("optim.lr=fast", "optim.lr: expected a number, got 'fast'"),
        ("batch.micro_batch_size=5", "valid micro_batch_size values for 2 processes: 1, 2, 4, 8, 16"),
        ("engine.processes=3", "cannot be split over 3 processes"),
        ("engine.sequence_parallel=3", "engine.sequence_parallel=3 does not divide the 2 processes; use one of 1, 2"),
        (
            "model.rope_scaling.rope_type=yarn model.rope_scaling.factor=0.5",
            "model.rope_scaling.factor: input should be greater than or equal to 1",
        ),
        ("train.loss_chunk_size=-1", "train.loss_chunk_size=-1 must be auto, 0 (the plain loss) or a number of tokens"),
        ("engine.hang_timeout_s=0", "engine.hang_timeout_s="),
        ("batch.micro_batch_size", "expected key.sub=value"),
        ("engine.deepspeed_config=/nowhere/ds.json", "engine.deepspeed_config: file not found: /nowhere/ds.json"),
        ("train.eval_on_start=maybe", "train.eval_on_start: expected"),
        # found by the first worker's checks on 2 processes (by this process on 1)
        (f"model.config.architecture=lama {HERE}", "unknown model type 'lama'; did you mean llama"),
        (
            f"model.config.architecture=bert model.rope_scaling.rope_type=linear model.rope_scaling.factor=2 {HERE}",
            "model.rope_scaling: a bert model has no rotary position embeddings (RoPE)",
        ),
        (
            f"data.generate.train_examples=8 {HERE}",
            "(8 examples packed into rows of 32 tokens) but batch.global_batch_size=32",
        ),
        # Enough examples, but packed 3-4 to a row they fill fewer rows than one global batch.
        (
            f"data.generate.train_examples=40 {HERE}",
            "(40 examples packed into rows of 32 tokens) but batch.global_batch_size=32",
        ),
        (
            f"data.packing=false data.generate.train_examples=8 {HERE}",
            "only 8 training examples but batch.global_batch_size=32",
        ),
    ],
)
def test_bad_input_fails_with_one_clear_line(tiny_recipe, tmp_path, override, needle):
    out = tmp_path / "out"
    proc = run_accord_here("train", tiny_recipe, *override.split(), f"output.dir={out}")
    assert_clean_error(proc, needle)
    assert not out.exists()


@pytest.mark.subprocess
def test_missing_recipe_file(tmp_path):
    assert_clean_error(run_accord("train", tmp_path / "nope.yaml", timeout=60), "recipe file not found")


def test_missing_model_folder(tiny_recipe, tmp_path):
    proc = run_accord_here("train", tiny_recipe, "model.config=null", f"model.path={tmp_path / 'no-model'}", HERE)
    assert_clean_error(proc, "model.path: folder not found")


def test_a_missing_run_output_names_the_run_to_train_first(tiny_recipe, tmp_path):
    """A model.path that is another run's final/ (a recipe continuing from the quickstart's):
    without it, the line says which run's output.dir writes that folder."""
    missing = tmp_path / "runs" / "quickstart" / "final"
    proc = run_accord_here("train", tiny_recipe, "model.config=null", f"model.path={missing}", HERE)
    assert_clean_error(
        proc,
        f"model.path: folder not found: {missing} "
        f"(the final model of an accord run: train the recipe whose output.dir is {missing.parent} first)",
    )


@pytest.mark.subprocess
def test_malformed_data_row_names_file_and_line(tiny_recipe, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
    proc = run_accord("train", tiny_recipe, "data.generate=null", f"data.train={data}", timeout=120)
    assert_clean_error(proc, f"{data}: row 2: field 'completion' is missing or null")


def test_malformed_json_line_names_file_and_line(tiny_recipe, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "a", "completion": \n')
    proc = run_accord_here("train", tiny_recipe, "data.generate=null", f"data.train={data}", HERE)
    assert_clean_error(proc, f"{data}:3: not valid JSON")


def test_help_explains_itself():
    top = run_accord_here("--help")
    assert top.returncode == 0 and "train" in top.stdout
    train = run_accord_here("train", "--help")
    assert train.returncode == 0
    assert "KEY=VALUE" in train.stdout and "torchrun" in train.stdout and "--overwrite" in train.stdout


def test_gpu_selection_on_a_cpu_machine_is_refused(tiny_recipe, tmp_path):
    # The recipe pins engine.device=cpu, so this holds on a GPU machine too.
    proc = run_accord_here("train", tiny_recipe, "--devices", "0,1", f"output.dir={tmp_path / 'o'}", HERE)
    assert_clean_error(proc, "engine.devices=[0, 1] selects GPUs but this run is on the CPU")


def test_model_folder_with_a_broken_config(tiny_recipe, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": "wide"}')
    proc = run_accord_here(
        "train", tiny_recipe, "model.config=null", f"model.path={folder}", "model.tokenizer=byte", HERE
    )
    assert_clean_error(proc, f"model.path: {folder}/config.json cannot be loaded")


@pytest.mark.parametrize(
    "accumulation, override, needle",
    [
        # accelerate's accumulation against a batch that does not split at all (a BatchPlanError)
        ("2", "batch.micro_batch_size=5", "batch.micro_batch_size=5 does not divide the 32 sequences per process"),
        # ... and against a batch that splits, but into another accumulation
        (
            "2",
            "batch.micro_batch_size=8",
            "gradient_accumulation_steps=2 but the recipe gives 4 (1 process × 8 sequences × 4",
        ),
    ],
)
def test_accelerate_accumulation_that_does_not_fit_is_one_line(tiny_recipe, tmp_path, accumulation, override, needle):
    # What `accelerate launch` with a single-process ZeRO-2 config puts in the worker's environment.
    env = {
        "ACCELERATE_MIXED_PRECISION": "no",
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": accumulation,
    }
    proc = run_accord_here(
        "train", tiny_recipe, "engine.strategy=zero2", override, f"output.dir={tmp_path / 'o'}", env_extra=env
    )
    assert_clean_error(proc, needle)


def test_what_the_machine_lacks_is_checked_before_start_not_in_the_recipe(tiny_recipe, tmp_path):
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        proc = run_accord_here("train", tiny_recipe, "engine.strategy=zero2", f"output.dir={tmp_path / 'o'}", HERE)
        assert_clean_error(proc, "engine.strategy=zero2 needs DeepSpeed, which is not installed: pip install deepspeed")
    else:
        proc = run_accord_here(
            "train", tiny_recipe, "engine.strategy=zero2", "engine.precision=fp16", f"output.dir={tmp_path / 'o'}", HERE
        )
        assert_clean_error(
            proc,
            "engine.precision=fp16 with engine.strategy=zero2 (DeepSpeed) needs a GPU: "
            "DeepSpeed has no fp16 on the CPU",
        )


def test_other_commands_fail_in_one_line_too(tiny_recipe, tmp_path):
    assert_clean_error(
        run_accord_here("plan", tiny_recipe, "--gpus", "2", "--gpu-memory", "lots"),
        "--gpu-memory 'lots': expected a size",
    )
    assert_clean_error(
        run_accord_here("plan", tiny_recipe, "batch.micro_batch_size=5", "--gpus", "2"), "valid micro_batch_size values"
    )
    assert_clean_error(run_accord_here("report", tmp_path), "no metrics.jsonl here")
    assert_clean_error(
        run_accord_here("config", tiny_recipe, "--out", tmp_path / "a.yaml", "--nodes", "2"),
        "--nodes > 1 needs --master-addr",
    )
