"""`accord import`: a TRL / transformers.Trainer job into a recipe, every key accounted for."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import random
import re
import shlex
from pathlib import Path

import pytest

from accord.interop.known import CONFIG_CLASSES, SCRIPT_CLASSES
from accord.interop.mapping import RULES
from conftest import assert_ok, run_accord, run_accord_here, save_tiny_byte_llama

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


def _recipe_key(dotted: str) -> bool:
    """`dotted` names a field of the Recipe schema (`*`: every source of a list of sources)."""
    import typing

    from pydantic import BaseModel

    from accord.recipe.schema import Recipe

    def sections(annotation):
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield annotation
        for arg in typing.get_args(annotation):
            yield from sections(arg)

    models = [Recipe]
    for part in dotted.replace(".*", "").split("."):
        found = [m.model_fields[part] for m in models if part in m.model_fields]
        if not found:
            return False
        models = [s for f in found for s in sections(f.annotation)]
    return True


def test_every_target_of_the_mapping_and_its_conversions_is_a_recipe_key():
    """A target the schema lacks writes a recipe that fails validation on import; the conversions'
    literal keys (conversions.py, mixture.py, deepspeed_json.py) are checked too, the DeepSpeed JSON's own
    keys aside."""
    from accord.interop import conversions, deepspeed_json, mixture
    from accord.interop.mapping import ACCELERATE_RULES

    assert _recipe_key("data.train.*.split") and not _recipe_key("data.test_split_size")
    bad = [f"{k} -> {r.target}" for k, r in [*RULES.items(), *ACCELERATE_RULES.items()] if r.target]
    bad = [b for b in bad if not _recipe_key(b.split(" -> ")[1])]
    assert not bad, f"mapping targets that are not recipe keys: {bad}"
    written = set()
    for module in (conversions, mixture, deepspeed_json):
        tree = ast.parse(Path(module.__file__).read_text())
        deepspeed = [n.value for n in ast.walk(tree) if isinstance(n, ast.Assign) and "_DS_TARGETS" in ast.unparse(n)]
        written |= {
            node.value
            for d in ast.walk(tree)
            if isinstance(d, ast.Dict)
            for node in (d.values if d in deepspeed else d.keys)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"[a-z_]+(\.[a-z_*]+)+", node.value)
        }
    assert {"data.eval_fraction", "engine.strategy", "batch.micro_batch_size"} <= written
    assert not [k for k in written if not _recipe_key(k)], "the conversions write keys the schema lacks"


def _mixture_job(tmp_path, test_split_size, handbook: bool):
    """A TRL `datasets:` mixture (or the alignment-handbook's dataset_mixture) of two local files."""
    import yaml

    files = []
    for name, n in (("a", 30), ("b", 10)):
        files.append(tmp_path / f"{name}.jsonl")
        files[-1].write_text("".join(json.dumps({"prompt": f"{name}{i}", "completion": "x"}) + "\n" for i in range(n)))
    if handbook:
        job = {"dataset_mixture": {"datasets": [{"id": str(f)} for f in files], "test_split_size": test_split_size}}
    else:
        job = {"datasets": [{"path": str(f)} for f in files], "test_split_size": test_split_size}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"model_name_or_path": "m", "max_steps": 10, **job}))
    return tmp_path / "job.yaml"


@pytest.mark.parametrize("handbook", [False, True], ids=["trl-datasets", "handbook-dataset_mixture"])
def test_a_mixtures_test_split_size_holds_out_that_share_of_the_mixed_rows(tmp_path, handbook):
    """TRL and the handbook call datasets' train_test_split(test_size=...) on the mixed rows: a
    float is the held-out share, accord's data.eval_fraction."""
    from accord.data.split import load_split
    from accord.interop.job import build_job, import_recipe, write_recipe
    from accord.recipe.schema import load_recipe
    from accord.tasks import task_class

    recipe, rows = import_recipe(build_job([str(_mixture_job(tmp_path, 0.25, handbook))], [], devices=1))
    assert recipe["data"]["eval_fraction"] == 0.25 and "test_split_size" not in recipe["data"]
    key = "dataset_mixture" if handbook else "test_split_size"
    assert any(r.key == key and "data.eval_fraction=0.25" in r.new for r in rows)
    write_recipe(recipe, tmp_path / "recipe.yaml")
    loaded = load_recipe(tmp_path / "recipe.yaml")
    train, held = load_split(loaded.data, loaded.seed, task_class(loaded.task).text_fields)
    assert (len(train), len(held)) == (30, 10)
    assert sorted(list(train["prompt"]) + list(held["prompt"])) == sorted(
        [f"a{i}" for i in range(30)] + [f"b{i}" for i in range(10)]
    )


def test_a_mixtures_per_dataset_shares_keep_the_rows_trl_and_the_handbook_keep(tmp_path, monkeypatch):
    """TRL's fraction is a share of the mixture (sized so no dataset repeats), counted against
    trl.get_dataset itself; the handbook's weight is the share of a dataset's rows kept."""
    import datasets
    import yaml
    from trl import DatasetMixtureConfig, get_dataset
    from trl.scripts.utils import DatasetConfig

    from accord.data.split import load_split
    from accord.interop.convert import RefusedKeys
    from accord.interop.job import build_job, import_recipe
    from accord.recipe.schema import validate_recipe

    job = _mixture_job(tmp_path, None, handbook=False)
    raw = yaml.safe_load(job.read_text())
    a, b = (tmp_path / "a.jsonl", tmp_path / "b.jsonl")
    raw["datasets"] = [{"path": str(a), "fraction": 0.7}, {"path": str(b), "fraction": 0.3}]
    job.write_text(yaml.safe_dump(raw))
    recipe, _ = import_recipe(build_job([str(job)], [], devices=1))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")  # TRL's load_dataset caches
    trl_rows = get_dataset(
        DatasetMixtureConfig(
            datasets=[DatasetConfig(path="json", data_files=str(f), fraction=x) for f, x in ((a, 0.7), (b, 0.3))]
        )
    )["train"]["prompt"]
    train, _ = load_split(validate_recipe(recipe).data, 0, ("prompt", "completion"))
    ours = list(train["prompt"])
    assert [sum(r.startswith(n) for r in ours) for n in "ab"] == [sum(r.startswith(n) for r in trl_rows) for n in "ab"]
    assert len(ours) == len(set(ours)) == 33  # 23 of a, all 10 of b: no row repeated

    raw = {"model_name_or_path": "m", "max_steps": 10}
    raw["dataset_mixture"] = {"datasets": [{"id": str(a), "weight": 0.5}, {"id": str(b), "weight": 1.0}]}
    job.write_text(yaml.safe_dump(raw))
    recipe, _ = import_recipe(build_job([str(job)], [], devices=1))
    assert recipe["data"]["train"] == [{"path": str(a), "fraction": 0.5}, {"path": str(b)}]

    raw = {"model_name_or_path": "m", "max_steps": 10, "datasets": [{"path": "org/hub", "fraction": 0.5}]}
    job.write_text(yaml.safe_dump(raw))
    with pytest.raises(RefusedKeys, match="accord counts them only for local JSONL files; nearest: count on each"):
        import_recipe(build_job([str(job)], [], devices=1))


def test_a_mixtures_builder_with_data_files_becomes_the_file_and_other_data_files_are_refused(tmp_path):
    """datasets' `path: json, data_files: a.jsonl` is the file; `text` reads a row per line."""
    import yaml

    from accord.interop.convert import RefusedKeys
    from accord.interop.job import build_job, import_recipe

    job = _mixture_job(tmp_path, None, handbook=False)
    (tmp_path / "c.txt").write_text("one\ntwo\n")
    raw = yaml.safe_load(job.read_text())
    raw["datasets"] = [
        {"path": "json", "data_files": str(tmp_path / "a.jsonl"), "fraction": 0.5},
        {"path": "text", "data_files": str(tmp_path / "c.txt"), "fraction": 0.5},
    ]
    job.write_text(yaml.safe_dump(raw))
    # c.txt is not JSONL, so the shares cannot be counted: refused; without fractions, both files as they are
    with pytest.raises(RefusedKeys, match="accord counts them only for local JSONL files"):
        import_recipe(build_job([str(job)], [], devices=1))
    for item in raw["datasets"]:
        del item["fraction"]
    job.write_text(yaml.safe_dump(raw))
    recipe, _ = import_recipe(build_job([str(job)], [], devices=1))
    assert recipe["data"]["train"] == [
        {"path": str(tmp_path / "a.jsonl")},
        {"path": str(tmp_path / "c.txt"), "format": "text", "document": "line"},
    ]
    raw["datasets"] = [{"path": "org/name", "data_files": ["x.jsonl", "y.jsonl"]}]
    job.write_text(yaml.safe_dump(raw))
    with pytest.raises(RefusedKeys, match="with data_files=.*nearest: path: the file itself"):
        import_recipe(build_job([str(job)], [], devices=1))


def test_a_mixture_wins_over_dataset_name_and_its_test_split_is_the_evaluation(tmp_path):
    """TRL's scripts load `datasets` when dataset_name is given too, and evaluate on the mixture's
    test split: data.train is the mixture, and no data.eval beside data.eval_fraction."""
    import yaml

    from accord.interop.job import build_job, import_recipe

    job = _mixture_job(tmp_path, 0.25, handbook=False)
    extra = {"dataset_name": str(tmp_path / "other.jsonl"), "eval_strategy": "steps", "eval_steps": 5}
    job.write_text(yaml.safe_dump(yaml.safe_load(job.read_text()) | extra))
    recipe, rows = import_recipe(build_job([str(job)], [], devices=1))
    assert [s["path"] for s in recipe["data"]["train"]] == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    assert recipe["data"]["eval_fraction"] == 0.25 and recipe["data"].get("eval") is None
    assert recipe["train"]["eval_every"] == 5
    assert any(r.key == "dataset_name" and "ignored" in r.note for r in rows)


@pytest.mark.parametrize("handbook", [False, True], ids=["trl-datasets", "handbook-dataset_mixture"])
def test_a_test_split_size_row_count_is_refused_with_the_fraction_it_is_of_the_mixture(tmp_path, handbook):
    """An int test_size is a count of rows: accord holds out a fraction, so the count is refused,
    naming the fraction it is of the local files' rows; a float outside (0, 1) is refused too."""
    from accord.interop.convert import RefusedKeys
    from accord.interop.job import build_job, import_recipe

    with pytest.raises(
        RefusedKeys,
        match=r"test_split_size 5 is a count of rows.*nearest: test_split_size: 0\.125 "
        r"\(5 of the mixture's 40 rows\)",
    ):
        import_recipe(build_job([str(_mixture_job(tmp_path, 5, handbook))], [], devices=1))
    with pytest.raises(RefusedKeys, match=r"test_split_size 1\.5 is neither a fraction in \(0, 1\) nor a row count"):
        import_recipe(build_job([str(_mixture_job(tmp_path, 1.5, handbook))], [], devices=1))


# ---------------------------------------------------------------- --verify: side by side with TRL's trainers


def _stand_ins(folder: Path) -> dict[str, Path]:
    """A tiny Llama folder with accord's byte tokenizer saved beside it (what a hub name would
    resolve to), and prompt/completion and preference rows written here."""
    model = save_tiny_byte_llama(folder / "model", max_positions=128)
    rng = random.Random(0)
    sft, dpo = [], []
    for _ in range(48):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        sft.append({"prompt": f"{a}+{b}=", "completion": str(a + b)})
        dpo.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + rng.randint(1, 9))})
    for name, rows in (("sft", sft), ("dpo", dpo)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": model, "sft": folder / "sft.jsonl", "dpo": folder / "dpo.jsonl"}


def _trl_command(task: str, files: dict[str, Path]) -> list[str]:
    return [
        "trl",
        task,
        "--model_name_or_path",
        str(files["model"]),
        "--dataset_name",
        str(files[task]),
        "--learning_rate",
        "1e-3",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "2",
        "--max_steps",
        "100",
        "--packing" if task == "sft" else "--beta",
        *([] if task == "sft" else ["0.2"]),
        "--output_dir",
        "out",
    ]


def test_verify_compares_in_accords_order_at_fp32_on_one_process_and_says_what_it_changed(tmp_path):
    from accord.interop.job import build_job, import_recipe
    from accord.interop.verify import comparable, peer_arguments
    from accord.recipe.schema import validate_recipe

    files = {"model": tmp_path / "m", "sft": tmp_path / "d.jsonl"}
    job = build_job([], _trl_command("sft", files), devices=2)
    recipe, _ = import_recipe(job)
    assert recipe["data"]["packing"] is True and recipe["engine"]["precision"] == "bf16"
    ready, causes = comparable(recipe, tmp_path, steps=5)
    assert ready["data"]["packing"] is False and any("packing" in c and "data.packing=false" in c for c in causes)
    engine = ready["engine"]
    assert (engine["precision"], engine["processes"], engine["device"]) == ("no", 1, "cpu")
    assert ready["train"]["max_steps"] == 5
    args = peer_arguments(job, validate_recipe(ready), tmp_path / "peer")
    # the original's global batch of 2 × 2 × 2 devices = 8 on one process, in the order given
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)
    assert args.train_sampling_strategy == "sequential" and args.max_steps == 5 and args.packing is False
    assert not args.bf16 and args.learning_rate == 1e-3 and args.seed == ready["seed"]


def test_verify_of_a_task_without_a_peer_or_no_steps_is_one_line(tmp_path):
    out = tmp_path / "r.yaml"
    proc = run_accord_here("import", "--devices", "1", "--verify", "0", "--out", out, "--", "trl", "sft")
    assert proc.returncode == 2 and "--verify 0: give the number of steps" in proc.stderr
    proc = run_accord_here("import", "--devices", "1", "--verify", "3", "--out", out, "--", "trl", "kto")
    assert proc.returncode == 2 and "not a kto job; import without --verify" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()
    proc = run_accord_here("import", "--devices", "1", "--verify", "3", "--out", out, "--", "trl", "sft", "--use_peft")
    assert proc.returncode == 2 and "--verify compares full fine-tunes" in proc.stderr


def _losses(stdout: str) -> list[tuple[float, float, float]]:
    return [tuple(map(float, m)) for m in re.findall(r"^\s+\d+\s+(\S+)\s+(\S+)\s+(\S+)$", stdout, re.M)]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("task", ["sft", "dpo"])
def test_verify_5_steps_equal_trls_trainer_step_by_step(tmp_path, task):
    files = _stand_ins(tmp_path)
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    command = ["import", cache, "--devices", "2", "--verify", "5", "--out", tmp_path / "r.yaml", "--"]
    proc = run_accord(*command, *_trl_command(task, files), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = _losses(proc.stdout)
    assert len(losses) == 5 and all(diff <= 1e-5 and abs(a - b) <= 1e-5 for a, b, diff in losses), proc.stdout
    assert "verify: the same job" in proc.stdout
    assert float(re.search(r"largest parameter difference after 5 steps: (\S+)", proc.stdout)[1]) < 1e-5
    if task == "sft":  # TRL packs here: compared unpacked on both sides, and said
        assert "verify: packing:" in proc.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_verify_names_the_loss_default_when_the_recipe_trains_other_tokens(tmp_path):
    """A recipe overridden to train the prompt too is not TRL's completion-only job: verify fails, naming it."""
    files = _stand_ins(tmp_path)
    proc = run_accord(
        "import", f"data.cache_dir={tmp_path / 'cache'}", "data.completion_only_loss=false", "--devices", "2",
        "--verify", "2", "--out", tmp_path / "r.yaml", "--", *_trl_command("sft", files),
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "NOT the same job" in proc.stdout and "completion_only_loss" in proc.stdout


def test_resume_from_checkpoint_becomes_the_recipes_resume(tmp_path):
    """A checkpoint-N path is kept; true is the newest checkpoint-N in output_dir (by step, not by name)."""
    from accord.interop.convert import RefusedKeys
    from accord.interop.job import build_job, import_recipe

    out = tmp_path / "out"
    for step in (2, 10):
        (out / f"checkpoint-{step}").mkdir(parents=True)
    args = ["trl", "sft", "--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--output_dir", str(out)]
    recipe, rows = import_recipe(build_job([], [*args, "--resume_from_checkpoint", str(out / "checkpoint-2")], 1))
    assert recipe["resume"] == str(out / "checkpoint-2")
    assert any(r.key == "resume_from_checkpoint" and r.decision == "changed" for r in rows)
    recipe, _ = import_recipe(build_job([], [*args, "--resume_from_checkpoint", "true"], 1))
    assert recipe["resume"] == str(out / "checkpoint-10")
    args[-1] = str(tmp_path / "elsewhere")
    with pytest.raises(RefusedKeys, match="holds no checkpoint-N folder"):
        import_recipe(build_job([], [*args, "--resume_from_checkpoint", "true"], 1))


@pytest.mark.slow
@pytest.mark.distributed
def test_verify_of_a_train_py_job_equals_transformers_trainer(tmp_path):
    """A train.py's Trainer tokenizes in the script: it is handed accord's token rows, in accord's order."""
    files = _stand_ins(tmp_path)
    (tmp_path / "train.py").write_text(
        "from transformers import AutoModelForCausalLM, Trainer, TrainingArguments\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(files['model'])!r})\n"
        "args = TrainingArguments('out', per_device_train_batch_size=2, gradient_accumulation_steps=2,\n"
        "                         learning_rate=1e-3, weight_decay=0.01, max_steps=50, seed=3)\n"
    )
    overrides = [f"data.train={files['sft']}", f"data.cache_dir={tmp_path / 'cache'}"]
    command = ["import", tmp_path / "train.py", *overrides, "--devices", "2", "--verify", "3"]
    proc = run_accord(*command, "--out", tmp_path / "r.yaml", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = _losses(proc.stdout)
    assert len(losses) == 3 and all(diff <= 1e-5 for _, _, diff in losses), proc.stdout
    assert "transformers.Trainer loss" in proc.stdout and "verify: the same job" in proc.stdout
