"""The rules for resuming: which checkpoints a run may continue from, which it verifies, and
what in a recipe may not change across a resume (the run's identity, its data order)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accord.checkpoint.manifest import verify
from accord.checkpoint.store import (
    CHECKPOINTS,
    COMPLETE,
    IDENTITY,
    NOT_IDENTITY,
    complete_checkpoints,
    latest_checkpoint,
    read_checkpoint_recipe,
    read_state,
)
from accord.checkpoint.trainer_folder import is_trainer_checkpoint
from accord.data.order import order_version, same_order
from accord.distributed import group as dist
from accord.errors import CheckpointError
from accord.output.folder import earlier_run
from accord.recipe.schema import Recipe
from accord.stopping import StartRefused
from accord.tasks import groups_by_length, task_class


def resume_candidates(out_dir: Path, resume: str, restarted: bool = False) -> list[Path]:
    """The checkpoints a run in `out_dir` (output.dir) may continue from, in order of
    preference (none: a fresh start): with `resume` auto every complete one, newest first;
    with resume=PATH that one.

    `restarted` is true in workers that the elastic agent restarted after a failure:
    they always continue from the latest checkpoint that verifies.
    """
    setting = "auto" if restarted else resume
    if setting == "never":
        return []
    if setting == "auto":
        return complete_checkpoints(out_dir / CHECKPOINTS)[::-1]
    folder = Path(setting)
    if is_trainer_checkpoint(folder):  # brought in by the launcher (trainer_folder.bring_in) before this
        raise CheckpointError(
            f"resume: {folder} is a transformers.Trainer checkpoint; start the run with accord train "
            "(or accord.train), which brings it in"
        )
    if not (folder / COMPLETE).is_file():
        raise CheckpointError(
            f"resume: {folder} is not a complete checkpoint (expected a checkpoints/step-NNNNNN folder with "
            f"{COMPLETE}, or a checkpoint-N folder written by transformers.Trainer)"
        )
    return [folder]


def verified_resume_source(out_dir: Path, resume: str, info: dist.DistInfo, restarted: bool = False) -> Path | None:
    """Collective: the newest candidate checkpoint whose files match their manifest, each rank
    checking its share of the files (checksums included) and all agreeing; the skipped ones
    are named, and left as they are. StartRefused when none verifies."""
    (candidates,) = dist.all_gather_objects(resume_candidates(out_dir, resume, restarted))[:1]  # rank 0's list for all
    skipped: list[tuple[Path, list[str]]] = []
    for folder in candidates:
        # resume=auto: each rank checks the copy in its own output.dir (a node may have its own folder).
        mine = out_dir / CHECKPOINTS / folder.name if restarted or resume == "auto" else folder
        problems = _unique(
            p
            for rank_problems in dist.all_gather_objects(verify(mine, info.rank, info.world_size))
            for p in rank_problems
        )
        if not problems:
            for bad, reasons in skipped:
                dist.print0(
                    f"accord: warning: checkpoint {bad.name} skipped: {_summary(reasons)}; resuming from {folder.name}"
                )
            return mine
        skipped.append((folder, problems))
    if skipped:
        raise StartRefused(_refusal(skipped, explicit=not restarted and resume != "auto"))
    return None


def _unique(items) -> list[str]:
    return list(dict.fromkeys(items))


def _summary(reasons: list[str]) -> str:
    return reasons[0] + (
        f" (and {len(reasons) - 1} more file{'s' if len(reasons) > 2 else ''})" if len(reasons) > 1 else ""
    )


def _refusal(skipped: list[tuple[Path, list[str]]], explicit: bool) -> str:
    """The one line for a resume with no usable checkpoint (`explicit`: the one resume=PATH
    names); nothing was touched."""
    if explicit:
        folder, reasons = skipped[0]
        return f"resume: {folder} is damaged: {_summary(reasons)}; resume from another checkpoint (resume=PATH)"
    detail = "; ".join(f"{folder.name}: {_summary(reasons)}" for folder, reasons in skipped)
    root = skipped[0][0].parent
    return (
        f"resume: no checkpoint in {root} verifies ({detail}); they are left as they are — restore their files, "
        f"or start over with --overwrite"
    )


def identity_changes(saved: dict[str, Any], recipe: Recipe) -> list[str]:
    """Fields that define the run and differ from the checkpoint's recipe. The saved recipe is
    read with this version's defaults first, so a field added since it was written (at its
    default) is no change."""
    current = recipe.model_dump(mode="json")
    try:
        saved = Recipe.model_validate(saved).model_dump(mode="json")
    except ValueError:
        pass  # a field since renamed or removed: compare what was written
    changes = []
    for key in IDENTITY:
        before, after = _get(saved, key), _get(current, key)
        for name, old, new in _diff(key, before, after):
            if name in NOT_IDENTITY:
                continue
            changes.append(f"{name} (checkpoint: {old!r}, recipe: {new!r})")
    return changes


def _get(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _diff(prefix: str, old: Any, new: Any) -> list[tuple[str, Any, Any]]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            out += _diff(f"{prefix}.{key}", old.get(key), new.get(key))
        return out
    return [] if old == new else [(prefix, old, new)]


def order_change(folder: Path, recipe: Recipe) -> str | None:
    """The line refusing a checkpoint taken in another global data order (an older accord's):
    the same steps would see other examples, so the run would not continue where it was."""
    saved = read_state(folder).data_order
    grouped = groups_by_length(recipe.data, task_class(recipe.task, recipe.model))
    if same_order(saved, recipe.data.shuffle, grouped):
        return None
    return (
        f"resume: {folder} was written in another data order "
        f"({saved or 'the stored permutation of checkpoints that do not record their order'}; "
        f"this accord shuffles with {order_version(recipe.data.shuffle, grouped)}), "
        "so the steps after it would see other examples; "
        f"finish that run with the accord that wrote it, or start a new run in another output.dir"
    )


def resume_hint(out_dir: Path) -> str:
    """How a run that stopped early continues, for the line that says it stopped."""
    latest = latest_checkpoint(out_dir)
    if latest is None:
        return "no checkpoint was written yet"
    return f"the latest checkpoint is {latest} — continue with --resume"


def check_resume(recipe: Recipe) -> list[str]:
    """Problems with resuming this recipe, found before any worker starts: sizes only (the
    checksums are the workers' to check, in parallel)."""
    out_dir = Path(recipe.output.dir)
    try:
        candidates = resume_candidates(out_dir, recipe.resume)
    except CheckpointError as e:
        return [str(e)]
    if not candidates:
        if recipe.resume == "auto":
            if earlier_run(out_dir) and not (out_dir / CHECKPOINTS).is_dir():
                return [
                    f"resume: {out_dir} holds a run but no checkpoint to continue from; pass --overwrite to start over"
                ]
        return []
    skipped = []
    for folder in candidates:
        problems = verify(folder, checksums=False)
        if not problems:
            break
        skipped.append((folder, problems))
    else:
        return [_refusal(skipped, explicit=recipe.resume != "auto")]
    changes = identity_changes(read_checkpoint_recipe(folder), recipe)
    order = order_change(folder, recipe)
    if order:
        return [order]
    if changes:
        return [
            f"resume: {folder} was written by a different run: {change}; a resumed run keeps "
            f"{', '.join(IDENTITY)} — restore it, or start a new run in another output.dir"
            for change in changes
        ]
    return []
