"""`accord import`: a TRL / transformers.Trainer job into a recipe, every key accounted for."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import shlex
from pathlib import Path

import pytest

from accord.interop.known import CONFIG_CLASSES, SCRIPT_CLASSES
from accord.interop.mapping import RULES
from conftest import assert_ok, run_accord, run_accord_here

pytest.importorskip("trl")


@pytest.mark.parametrize("module, name", [*CONFIG_CLASSES.values(), *SCRIPT_CLASSES], ids=lambda v: str(v))
def test_every_field_of_each_trl_config_class_has_a_decision(module, name):
    cls = getattr(importlib.import_module(module), name)
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in RULES]
    assert not missing, f"{name} fields without a rule in accord.interop.mapping.RULES: {missing}"


def _docstring_commands(script: str) -> list[str]:
    import trl.scripts

    path = Path(trl.scripts.__file__).parent / f"{script}.py"
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return [" ".join(block.split()) for block in re.findall(r"```bash\n(.*?)```", doc, re.S)]


def _tiny_model(folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=259,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_an_unknown_key_is_one_line_with_a_did_you_mean(tmp_path, capsys):
    (tmp_path / "sft.yaml").write_text("model_name_or_path: m\nlearning_rat: 1.0e-5\n")
    proc = run_accord_here("import", tmp_path / "sft.yaml", "--devices", "1", "--out", tmp_path / "r.yaml")
    assert proc.returncode == 2
    assert "unknown key 'learning_rat'; did you mean learning_rate?" in proc.stderr
    assert not (tmp_path / "r.yaml").exists()


def test_training_arguments_built_from_variables_are_named(tmp_path):
    (tmp_path / "train.py").write_text(
        "from transformers import TrainingArguments\nlr = 1e-4\nargs = TrainingArguments('out', learning_rate=lr)\n"
    )
    proc = run_accord_here("import", tmp_path / "train.py", "--devices", "1", "--out", tmp_path / "r.yaml")
    assert proc.returncode == 2
    assert "train.py:3: TrainingArguments(...) sets learning_rate=lr from variables" in proc.stderr


def test_without_a_device_count_the_global_batch_is_refused(tmp_path):
    proc = run_accord_here("import", "--out", tmp_path / "r.yaml", "--", "trl", "sft", "--model_name_or_path", "m")
    assert proc.returncode == 2
    assert "the global batch needs the device count the original ran on" in proc.stderr


def test_a_train_py_and_deepspeed_json_map_batch_precision_and_schedule(tmp_path):
    from accord.interop.job import build_job, import_recipe

    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}')
    (tmp_path / "train.py").write_text(
        "from trl import SFTConfig\n"
        f"args = SFTConfig(output_dir='o', per_device_train_batch_size=4, gradient_accumulation_steps=2, "
        "max_steps=100, warmup_steps=0.1, lr_scheduler_type='cosine', bf16=False, "
        f"deepspeed={str(tmp_path / 'ds.json')!r})\n"
    )
    recipe, rows = import_recipe(
        build_job([str(tmp_path / "train.py")], [], devices=4), ["model.path=m", "data.train=d.jsonl"]
    )
    assert recipe["batch"] == {"micro_batch_size": 4, "global_batch_size": 32}
    assert recipe["optim"]["warmup_steps"] == 10 and recipe["optim"]["schedule"] == "cosine"
    assert recipe["engine"]["strategy"] == "zero2" and recipe["engine"].get("precision", "no") == "no"
    keys = {r.key for r in rows}
    assert {"per_device_train_batch_size", "warmup_steps", "deepspeed", "zero_optimization.stage"} <= keys
    # an explicit DeepSpeed value that contradicts the job is refused, naming both
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 8}')
    with pytest.raises(Exception, match=r"train_micro_batch_size_per_gpu=8 but the job gives batch.micro_batch_size=4"):
        import_recipe(build_job([str(tmp_path / "train.py")], [], devices=4), ["model.path=m", "data.train=d.jsonl"])


@pytest.mark.subprocess
@pytest.mark.parametrize("script", ["sft", pytest.param("dpo", marks=pytest.mark.slow)])
def test_trl_docstring_examples_import_to_recipes_accord_plan_accepts(tmp_path, script):
    model = _tiny_model(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "a", "completion": "b", "chosen": "b", "rejected": "c"}\n' * 8)
    for i, example in enumerate(_docstring_commands(script)):
        tokens = shlex.split(example)
        if "--eos_token" in tokens:  # refused (no recipe key): shown once, then imported without it
            proc = run_accord_here("import", "--devices", "8", "--out", tmp_path / "x.yaml", "--", *tokens)
            assert proc.returncode == 2 and "eos_token" in proc.stderr
            at = tokens.index("--eos_token")
            tokens = tokens[:at] + tokens[at + 2 :]
        out = tmp_path / f"{script}{i}.yaml"
        overrides = [
            f"model.path={model}",
            "model.tokenizer=byte",
            f"data.train={data}",
            f"output.dir={tmp_path / 'run'}",
        ]
        overrides += [f"data.eval={data}"] if "--eval_strategy" in tokens else []
        proc = run_accord_here("import", *overrides, "--devices", "8", "--out", out, "--", *tokens)
        assert proc.returncode == 0, proc.stderr
        for key in [t[2:].split("=")[0].removeprefix("no_") for t in tokens if t.startswith("--")]:
            assert re.search(rf"^{key} ", proc.stdout, re.M), f"{key} missing from the report"
        assert_ok(run_accord("plan", out))


def test_the_docs_mapping_table_is_generated_from_the_importers_table():
    """Regenerate with: python -c "from accord.interop.mapping import markdown_table; print(markdown_table())"
    pasted between the markers of docs/coming-from-trl.md."""
    from accord.interop.mapping import markdown_table

    text = (Path(__file__).parents[1] / "docs" / "coming-from-trl.md").read_text()
    table = text.split("<!-- mapping:start -->\n")[1].split("\n<!-- mapping:end -->")[0]
    assert table == markdown_table()
