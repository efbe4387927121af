"""Reading a job's inputs: a TRL YAML, a TRL command line (`trl sft ...`, `python sft.py ...`,
`accelerate launch ... sft.py ...`), a train.py's config call (read with ast, never run), a
DeepSpeed JSON and an accelerate config. Each gives keys with where they came from."""

from __future__ import annotations

import ast
import json
import shlex
from pathlib import Path
from typing import Any

import yaml

from accord.interop.job_keys import Entry, ImportError_, Job
from accord.interop.known import CONFIG_CLASSES, accelerate_keys, task_fields

# A config class a train.py may build -> the task it trains.
CLASS_TASKS = {name: task for task, (_, name) in CONFIG_CLASSES.items()}
SCRIPT_TASKS = {"sft", "dpo", "grpo", "kto", "reward", "rloo", "orpo", "cpo", "distillation"}


def read_inputs(paths: list[str], command: list[str], task: str | None) -> Job:
    """Every input into one Job (a key given twice with different values is an error)."""
    job = Job(task=task or "")
    pending: list[tuple[str, dict[str, Any]]] = []  # (origin, raw TRL keys), typed once the task is known
    for path in paths:
        kind = _kind(path)
        if kind == "command":
            _read_command(shlex.split(_command_text(path)), job, pending, origin=path)
        elif kind == "python":
            found_task, keys = read_train_py(path)
            job.task = job.task or found_task
            pending.append((path, keys))
        elif kind == "deepspeed":
            read_deepspeed(path, job)
        elif kind == "accelerate":
            read_accelerate(path, job)
        else:
            pending.append((path, _yaml_mapping(path)))
    if command:
        _read_command(command, job, pending, origin="command line")
    job.task = job.task or "sft"
    if job.task not in CONFIG_CLASSES:
        raise ImportError_(f"task {job.task!r}: accord import reads {', '.join(CONFIG_CLASSES)} jobs")
    for origin, keys in pending:
        for key, value in keys.items():
            _add(job, key, value, origin)
    ds = job.entries.get("deepspeed")
    if ds is not None and isinstance(ds.value, str):
        read_deepspeed(ds.value, job)
    return job


def _add(job: Job, key: str, value: Any, origin: str) -> None:
    if key in ("config",):  # TRL's --config FILE: its keys, then the command's
        for k, v in _yaml_mapping(str(value)).items():
            if k not in job.entries:
                _add(job, k, v, str(value))
        return
    earlier = job.entries.get(key)
    if earlier is not None and earlier.value != value:
        raise ImportError_(
            f"{key} is {earlier.value!r} in {earlier.origin} but {value!r} in {origin}; keep one of them"
        )
    job.entries[key] = Entry(key, value, origin)


def _kind(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise ImportError_(f"input not found: {path}")
    if p.suffix == ".py":
        return "python"
    if p.suffix == ".json":
        return "deepspeed"
    if p.suffix in (".sh", ".txt", ".cmd"):
        return "command"
    data = _yaml_mapping(path)
    return "accelerate" if {"distributed_type", "compute_environment"} & set(data) else "trl"


def _yaml_mapping(path: str) -> dict[str, Any]:
    if not Path(path).is_file():
        raise ImportError_(f"input not found: {path}")
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ImportError_(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ImportError_(f"{path}: expected a mapping of keys, got {type(data).__name__}")
    return data


def _command_text(path: str) -> str:
    """A shell file's command, its line continuations joined, comments left out."""
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if not line.lstrip().startswith("#")]
    return " ".join(line.rstrip().removesuffix("\\") for line in lines)


# ---------------------------------------------------------------- command lines


def _read_command(tokens: list[str], job: Job, pending: list, origin: str) -> None:
    tokens = list(tokens)
    while tokens and ("=" in tokens[0] and not tokens[0].startswith("-")):
        tokens.pop(0)  # VAR=value prefixes
    if not tokens:
        raise ImportError_(f"{origin}: empty command")
    head = Path(tokens[0]).name
    if head == "accelerate":
        if tokens[1:2] != ["launch"]:
            raise ImportError_(f"{origin}: expected `accelerate launch ...`, got {' '.join(tokens[:2])}")
        tokens = _read_accelerate_launch(tokens[2:], job, origin)
        head = Path(tokens[0]).name if tokens else ""
    if head == "trl":
        if len(tokens) < 2 or tokens[1] not in SCRIPT_TASKS:
            raise ImportError_(f"{origin}: expected `trl sft|dpo|grpo|kto|reward ...`")
        script, args = tokens[1], tokens[2:]
    elif head.startswith("python"):
        if tokens[1:2] == ["-m"]:
            script, args = tokens[2].rsplit(".", 1)[-1], tokens[3:]
        else:
            script, args = Path(tokens[1]).stem, tokens[2:]
    elif head.endswith(".py"):
        script, args = Path(head).stem, tokens[1:]
    else:
        raise ImportError_(f"{origin}: not a TRL command (trl sft ..., python sft.py ..., accelerate launch ...)")
    task = "distillation" if script == "distillation" else script
    if task in SCRIPT_TASKS:
        job.task = job.task or task
    pending.append((origin, parse_arguments(args, job.task or "sft", origin)))


def parse_arguments(args: list[str], task: str, origin: str) -> dict[str, Any]:
    """HfArgumentParser's forms: `--key value`, `--key=value`, a bare `--flag` (true), `--no_flag`
    (false), several values for a list field; values typed by the installed field's type."""
    fields = task_fields(task) if task in CONFIG_CLASSES else task_fields("sft")
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        item = args[i]
        i += 1
        if not item.startswith("--"):
            raise ImportError_(f"{origin}: unexpected argument {item!r} (expected --key value)")
        name, eq, text = item[2:].partition("=")
        name = name.replace("-", "_")
        if name.startswith("no_") and name[3:] in fields and fields[name[3:]].is_bool:
            out[name[3:]] = False
            continue
        field = fields.get(name)
        if eq:
            values = [text]
        else:
            values = []
            while i < len(args) and not args[i].startswith("--"):
                values.append(args[i])
                i += 1
        if field is not None and field.is_bool:
            out[name] = True if not values else _boolean(values[0], name, origin)
        elif field is not None and field.is_list:
            out[name] = [_scalar(v) for v in values]
        elif len(values) == 1:
            out[name] = _scalar(values[0])
        else:
            out[name] = [_scalar(v) for v in values] if values else True
    return out


def _boolean(text: str, name: str, origin: str) -> bool:
    if text.lower() in ("true", "yes", "1"):
        return True
    if text.lower() in ("false", "no", "0"):
        return False
    raise ImportError_(f"{origin}: --{name} takes true or false, got {text!r}")


def _scalar(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


# `accelerate launch` flags -> the accelerate config key they set
_LAUNCH_FLAGS = {
    "num_processes": "num_processes",
    "num_machines": "num_machines",
    "mixed_precision": "mixed_precision",
    "config_file": None,
    "multi_gpu": ("distributed_type", "MULTI_GPU"),
    "use_deepspeed": ("distributed_type", "DEEPSPEED"),
    "use_fsdp": ("distributed_type", "FSDP"),
    "cpu": "use_cpu",
    "zero_stage": "deepspeed_config.zero_stage",
    "offload_optimizer_device": "deepspeed_config.offload_optimizer_device",
    "offload_param_device": "deepspeed_config.offload_param_device",
    "deepspeed_config_file": "deepspeed_config.deepspeed_config_file",
    "gradient_accumulation_steps": "deepspeed_config.gradient_accumulation_steps",
    "fsdp_activation_checkpointing": "fsdp_config.fsdp_activation_checkpointing",
}


def _read_accelerate_launch(tokens: list[str], job: Job, origin: str) -> list[str]:
    """accelerate's own launch parser reads its flags; returns the script and its arguments."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    script = next((i for i, t in enumerate(tokens) if not t.startswith("-") and _is_script(t)), None)
    if script is None:
        raise ImportError_(f"{origin}: accelerate launch without a training script")
    try:
        parsed = parser.parse_args([*tokens[:script], "x.py"])
    except SystemExit:
        raise ImportError_(f"{origin}: accelerate launch cannot read {' '.join(tokens[:script])}") from None
    defaults = vars(parser.parse_args(["x.py"]))
    config: dict[str, Any] = {}
    for name, value in vars(parsed).items():
        if name in ("training_script", "training_script_args") or value == defaults.get(name):
            continue
        if name == "config_file":
            read_accelerate(value, job)
            continue
        where = _LAUNCH_FLAGS.get(name, name)
        key, value = where if isinstance(where, tuple) else (where, value)
        section, _, sub = key.partition(".")
        if sub:
            config.setdefault(section, {})[sub] = value
        else:
            config[key] = value
    _accelerate_entries(config, job, f"{origin} (accelerate launch)")
    if tokens[script] == "-m":
        return ["python", *tokens[script:]]
    return tokens[script:]


def _is_script(token: str) -> bool:
    return token.endswith(".py") or token in ("trl", "-m") or token.startswith("python")


# ---------------------------------------------------------------- accelerate config, DeepSpeed JSON


def read_accelerate(path: str, job: Job) -> None:
    _accelerate_entries(_yaml_mapping(path), job, path)


def _accelerate_entries(config: dict[str, Any], job: Job, origin: str) -> None:
    import difflib

    known = accelerate_keys()
    for key, value in config.items():
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            raise ImportError_(
                f"{origin}: unknown accelerate config key {key!r}" + (f"; did you mean {close[0]}?" if close else "")
            )
        job.launch[key] = Entry(key, value, origin)
    if "num_processes" in config:
        machines = int(config.get("num_machines", 1) or 1)
        job.devices, job.nodes = int(config["num_processes"]) // machines, machines
    ds_file = (config.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if ds_file:
        read_deepspeed(ds_file, job)


def read_deepspeed(path: str, job: Job) -> None:
    if not Path(path).is_file():
        raise ImportError_(f"DeepSpeed config not found: {path}")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ImportError_(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    for key, value in _flatten(data).items():
        job.deepspeed[key] = Entry(key, value, path)


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key in ("zero_optimization", "bf16", "fp16"):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


# ---------------------------------------------------------------- train.py, read and never run


def read_train_py(path: str) -> tuple[str | None, dict[str, Any]]:
    """(task, keys) of the config call in a training script: TrainingArguments(...), SFTConfig(...),
    ...; also the model and dataset of `from_pretrained("...")` / `load_dataset("...")` literals.
    A keyword that is not a literal is named, with its line: the values cannot be read statically."""
    source = Path(path).read_text(encoding="utf-8")
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        raise ImportError_(f"{path}:{e.lineno}: not valid Python ({e.msg})") from None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _name(n.func) in CLASS_TASKS]
    if not calls:
        raise ImportError_(
            f"{path}: no {', '.join(CLASS_TASKS)} call found (the importer reads the config call's keyword arguments)"
        )
    call = calls[0]
    keys: dict[str, Any] = {}
    unreadable = []
    for index, arg in enumerate(call.args):
        if index == 0:
            keys["output_dir"] = _literal(arg, unreadable, "output_dir")
    for keyword in call.keywords:
        if keyword.arg is None:
            unreadable.append(f"**{ast.unparse(keyword.value)}")
            continue
        keys[keyword.arg] = _literal(keyword.value, unreadable, keyword.arg)
    if unreadable:
        raise ImportError_(
            f"{path}:{call.lineno}: {_name(call.func)}(...) sets {', '.join(unreadable)} from variables, which cannot "
            f"be read without running the script; write literal values there, or give them as a YAML file to import"
        )
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = _name(node.func)
            if name == "from_pretrained" and "model_name_or_path" not in keys:
                keys["model_name_or_path"] = node.args[0].value
            elif name == "load_dataset" and "dataset_name" not in keys:
                keys["dataset_name"] = node.args[0].value
    return CLASS_TASKS[_name(call.func)], {k: v for k, v in keys.items() if v is not None or k != "output_dir"}


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _literal(node: ast.expr, unreadable: list[str], key: str) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        unreadable.append(f"{key}={ast.unparse(node)}")
        return None
