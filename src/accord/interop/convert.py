"""A job's keys through the table (mapping.py) into a recipe, and one report row per key.

The job's values are its given keys over the TRL class's own defaults: a TRL default that
differs from accord's (learning rate, linear schedule, seed 42, bf16, gradient checkpointing,
max_length 1024, ...) is written into the recipe too, so the recipe trains what the original
trained, and its row says it came from TRL's default. Each key's conversion is in
conversions.py, a DeepSpeed JSON's keys are checked in deepspeed_json.py."""

from __future__ import annotations

import difflib
from typing import Any

from accord.errors import UserInputError
from accord.interop.conversions import CONVERSIONS, lora_key, source_key
from accord.interop.deepspeed_json import deepspeed_row
from accord.interop.job_keys import Entry, ImportError_, Job, Row
from accord.interop.known import Field, all_keys
from accord.interop.mapping import ACCELERATE_RULES, RULES, Refused, Rule

# Importable from here as before: the job's types and the import's errors.
__all__ = ["Entry", "ImportError_", "Job", "RefusedKeys", "Row", "check_known", "convert"]


def check_known(job: Job) -> None:
    """Every key of the inputs is one the installed classes (or the table's older names) know."""
    known = set(job.fields) | set(RULES)
    for key, entry in job.entries.items():
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known | all_keys()), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ImportError_(
                f"{entry.origin}: unknown key {key!r}{hint} (not a field of the installed TRL/transformers "
                f"{job.task} config, ModelConfig or ScriptArguments)"
            )


def _convert(rule: Rule, value: Any, job: Job) -> dict[str, Any]:
    if rule.decision in ("dropped",):
        return {}
    if rule.how == "flag":
        return {rule.target: bool(value)}
    if rule.how == "source_key":
        return source_key(rule.target)(value, job)
    if rule.target.startswith("lora.") and not rule.how:
        return lora_key(rule.target)(value, job)
    convert = CONVERSIONS[rule.how]
    if convert:
        return convert(value, job)
    return {} if value is None else {rule.target: value}


def _default_of(field_: Field | None) -> Any:
    return None if field_ is None else field_.default


# The order the table's conversions run: the sources exist before keys are set on each of them.
_FIRST = ("dataset", "mixture", "handbook_mixture", "mixer")


def convert(job: Job) -> tuple[dict[str, Any], list[Row]]:
    """(the recipe as a nested dict, one row per key of the inputs and per TRL default written)."""
    from accord.interop.recipe_keys import MISSING, accord_default, put

    check_known(job)
    recipe: dict[str, Any] = {"task": "sft" if job.task == "trainer" else job.task}
    rows: list[Row] = []
    refusals: list[str] = []
    given = [(k, e.value, e.origin, RULES[k]) for k, e in job.entries.items()]
    # The TRL class's defaults that carry meaning (a target, a conversion): written where they differ from accord's.
    defaults = [
        (k, f.default, "TRL default", RULES[k])
        for k, f in job.fields.items()
        if k in RULES and not job.given(k) and RULES[k].decision in ("mapped", "changed") and RULES[k].target
    ]
    launch = [(k, e.value, e.origin, ACCELERATE_RULES[k]) for k, e in job.launch.items()]
    items = sorted(given + defaults + launch, key=lambda item: item[3].how not in _FIRST)
    for key, value, origin, rule in items:
        try:
            updates = _convert(rule, value, job) if rule.decision != "refused" else None
        except Refused as e:
            refusals.append(f"{key}={value!r}: {e.reason}; nearest: {e.nearest}")
            rows.append(Row(key, origin, value, "refused", "", f"{e.reason}; use {e.nearest}"))
            continue
        if updates is None:  # a refused key: only at TRL's default (off) it does nothing
            if value == _default_of(job.fields.get(key)) or value in (None, False, [], {}):
                rows.append(Row(key, origin, value, "dropped", "", f"at its default (off), as in accord ({rule.note})"))
            else:
                refusals.append(f"{key}={value!r}: {rule.note}; nearest: {rule.nearest}")
                rows.append(Row(key, origin, value, "refused", "", f"{rule.note}; use {rule.nearest}"))
            continue
        note = updates.pop("_note", rule.note)
        if origin == "TRL default":
            updates = {k: v for k, v in updates.items() if accord_default(k) not in (MISSING, v)}
            if not updates:
                continue
        for k, v in updates.items():
            put(recipe, k, v)
        new = ", ".join(f"{k}={v!r}" for k, v in updates.items())
        decision = rule.decision if updates or rule.decision == "changed" else "mapped"
        rows.append(Row(key, origin, value, decision if updates else _nothing(rule), new, note))
    for key, entry in job.deepspeed.items():
        rows.append(deepspeed_row(key, entry, recipe, job, refusals))
    if refusals:
        raise RefusedKeys(rows, refusals)
    return recipe, rows


def _nothing(rule: Rule) -> str:
    return "mapped" if rule.decision == "mapped" else rule.decision


class RefusedKeys(UserInputError):
    """Keys accord cannot run; the report rows are kept so the table is still printed."""

    def __init__(self, rows: list[Row], refusals: list[str]):
        super().__init__(
            f"{len(refusals)} key(s) refused (no recipe written): " + "; ".join(refusals) + " — change or remove them"
        )
        self.rows = rows
