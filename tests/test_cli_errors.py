"""User mistakes: one clear line each, a non-zero exit, no traceback, before any worker starts."""

import pytest

from conftest import run_accord


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
        ("batch.micro_batch_sise=4", "unknown key batch.micro_batch_sise; did you mean batch.micro_batch_size?"),
        ("optim.lr=fast", "optim.lr: expected a number, got 'fast'"),
        ("batch.micro_batch_size=5", "valid micro_batch_size values for 2 processes: 1, 2, 4, 8, 16"),
        ("engine.processes=3", "cannot be split over 3 processes"),
        ("model.config.architecture=lama", "unknown model type 'lama'; did you mean llama"),
        ("data.generate.train_examples=8", "only 8 training examples"),
        ("batch.micro_batch_size", "expected key.sub=value"),
        ("engine.deepspeed_config=/nowhere/ds.json", "engine.deepspeed_config: file not found: /nowhere/ds.json"),
        ("train.eval_on_start=maybe", "train.eval_on_start: expected"),
    ],
)
def test_bad_input_fails_with_one_clear_line(tiny_recipe, tmp_path, override, needle):
    out = tmp_path / "out"
    proc = run_accord("train", tiny_recipe, override, f"output.dir={out}", timeout=60)
    assert_clean_error(proc, needle)
    assert not out.exists()


def test_missing_recipe_file(tmp_path):
    assert_clean_error(run_accord("train", tmp_path / "nope.yaml", timeout=60), "recipe file not found")


def test_missing_model_folder(tiny_recipe, tmp_path):
    proc = run_accord("train", tiny_recipe, "model.config=null", f"model.path={tmp_path / 'no-model'}", timeout=60)
    assert_clean_error(proc, "model.path: folder not found")


def test_malformed_data_row_names_file_and_line(tiny_recipe, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
    proc = run_accord("train", tiny_recipe, "data.generate=null", f"data.train={data}", timeout=60)
    assert_clean_error(proc, f"{data}: row 2: field 'completion' is missing or null")


def test_malformed_json_line_names_file_and_line(tiny_recipe, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "a", "completion": \n')
    proc = run_accord("train", tiny_recipe, "data.generate=null", f"data.train={data}", timeout=60)
    assert_clean_error(proc, f"{data}:3: not valid JSON")


def test_help_explains_itself():
    top = run_accord("--help", timeout=60)
    assert top.returncode == 0 and "train" in top.stdout
    train = run_accord("train", "--help", timeout=60)
    assert train.returncode == 0
    assert "KEY=VALUE" in train.stdout and "torchrun" in train.stdout and "--overwrite" in train.stdout


def test_gpu_selection_on_a_cpu_machine_is_refused(tiny_recipe, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_accord("train", tiny_recipe, "--devices", "0,1", f"output.dir={tmp_path / 'o'}", timeout=60)
    assert_clean_error(proc, "engine.devices=[0, 1] selects GPUs but this run is on the CPU")


def test_model_folder_with_a_broken_config(tiny_recipe, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": "wide"}')
    proc = run_accord("train", tiny_recipe, "model.config=null", f"model.path={folder}", "model.tokenizer=byte", timeout=60)
    assert_clean_error(proc, f"model.path: {folder}/config.json cannot be loaded")
