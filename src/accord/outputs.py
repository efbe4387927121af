"""The run's output folder: refuse to clobber an earlier run, write atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from accord.recipe import Recipe, recipe_to_yaml

# What a run writes; only these are removed by --overwrite (never the whole folder, which
# may hold the user's own files).
RUN_ARTEFACTS = ("recipe.yaml", "metrics.jsonl", "tensorboard", "checkpoints", "final")


def earlier_run(out_dir: Path) -> list[str]:
    return [name for name in RUN_ARTEFACTS if (out_dir / name).exists()]


def check_output_dir(recipe: Recipe) -> list[str]:
    """Problems with output.dir, found before any work starts."""
    out_dir = Path(recipe.output.dir)
    if out_dir.exists() and not out_dir.is_dir():
        return [f"output.dir: {out_dir} exists and is not a folder"]
    found = earlier_run(out_dir)
    if recipe.output.overwrite and recipe.resume != "never":
        return ["--overwrite starts over and --resume / resume continues: choose one"]
    if found and not recipe.output.overwrite and recipe.resume == "never":
        return [
            f"output.dir: {out_dir} already holds a run ({', '.join(found)}); "
            f"pass --resume to continue it, --overwrite to replace it, or choose another output.dir=..."
        ]
    parent = out_dir if out_dir.exists() else _existing_parent(out_dir)
    if not os.access(parent, os.W_OK):
        return [f"output.dir: cannot write under {parent}"]
    return []


def prepare_output_dir(recipe: Recipe, clear: bool) -> Path:
    """Create output.dir (clearing an earlier run's artefacts when `clear`) and save the recipe."""
    out_dir = Path(recipe.output.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if clear:
        for name in earlier_run(out_dir):
            target = out_dir / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
    write_text_atomic(out_dir / "recipe.yaml", recipe_to_yaml(recipe))
    return out_dir


def save_final_model(module, tokenizer, final: Path, state_dict: dict | None = None) -> None:
    """save_pretrained (safetensors) into a temporary sibling, then rename into place.
    `state_dict`: the full weights when the module itself holds only a shard."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        module.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path
