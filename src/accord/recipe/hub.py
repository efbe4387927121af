"""Hugging Face hub names wherever a recipe takes a path: `ORG/NAME` (with a revision) read
through huggingface_hub's own cache, which honours HF_HOME, HF_HUB_OFFLINE and HF_TOKEN as it
reads them (accord never passes, prints or writes a token).

The one place that decides which commit a run reads: `pin` resolves every hub name of a
recipe once (a download when online and not cached, else the cache) and writes the commit
hash into the recipe as its `revision`, so the run's recipe.yaml, its workers and a resume or
rerun read that same commit; everything after reads the pinned snapshot with
`local_path`, from the cache only. A local folder of the same name wins, as in transformers.
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accord.atomic import write_atomic
from accord.errors import UserInputError
from accord.recipe.paths import resolve_path

_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_COMMIT = re.compile(r"[0-9a-f]{40}")


class HubError(UserInputError):
    """A hub name that cannot be read; the message names the repository and how to get it."""


# A missing `dir/file.jsonl` is a missing file, not a repository: hub names do not end so.
_FILE_SUFFIXES = {".jsonl", ".json", ".csv", ".tsv", ".parquet", ".txt", ".yml", ".yaml", ".gguf", ".arrow", ".md"}


def is_hub_name(text: str) -> bool:
    """ORG/NAME that is not a local file or folder (a local one of that name wins)."""
    return (
        bool(_NAME.fullmatch(text))
        and Path(text).suffix.lower() not in _FILE_SUFFIXES
        and not Path(text).expanduser().exists()
    )


def local_path(text: str, revision: str | None = None, repo_type: str = "model", where: str = "") -> Path:
    """A recipe's path as a local one: a hub name as its snapshot folder in the cache (the
    commit `pin` chose), anything else as resolve_path gives it."""
    if not is_hub_name(text):
        return resolve_path(text)
    return snapshot(text, revision, repo_type, where, cached_only=True)


def snapshot(text: str, revision: str | None, repo_type: str, where: str, cached_only: bool = False) -> Path:
    """The snapshot folder of `text` at `revision`: huggingface_hub's snapshot_download, which
    reads the cache first and downloads only what is missing (never when offline)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    label = f"{where}: " if where else ""
    kind = f" --repo-type {repo_type}" if repo_type != "model" else ""
    at = f" --revision {revision}" if revision else ""
    try:
        return Path(snapshot_download(text, repo_type=repo_type, revision=revision, local_files_only=cached_only))
    except GatedRepoError:
        raise HubError(
            f"{label}{text} is gated: accept its terms on huggingface.co and log in (`hf auth login`, or set HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise HubError(f"{label}{text} has no revision {revision!r}; give a branch, tag or commit it has") from None
    except RepositoryNotFoundError:
        raise HubError(
            f"{label}{text}: no such {repo_type} repository on the hub, or it is private: log in (`hf auth login`, "
            "or set HF_TOKEN) or give a local path"
        ) from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            why = "downloads are off (HF_HUB_OFFLINE)"
        else:
            why = "this step reads the cache only" if cached_only else "the hub cannot be reached"
        raise HubError(
            f"{label}{text}{'@' + revision if revision else ''} is not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) and {why}: fetch it with `hf download {text}{kind}{at}` or give a local path"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        reason = " ".join(str(e).split())[:200]
        raise HubError(f"{label}{text} cannot be downloaded: {type(e).__name__}: {reason}") from None


@dataclass(frozen=True)
class HubRef:
    """A recipe field naming a hub repository: `key` its place (model.path), `owner` the section."""

    key: str
    place: tuple  # the owner's place in a recipe.yaml mapping: ("data", "train", 0)
    owner: Any
    name_field: str
    revision_field: str
    repo_type: str


def hub_refs(recipe) -> list[HubRef]:
    """Every hub name in a recipe: model and tokenizer, data sources, grpo's reward models, distill's teacher."""
    refs = []
    model = recipe.model
    if model.path and is_hub_name(model.path):
        refs.append(HubRef("model.path", ("model",), model, "path", "revision", "model"))
    if model.tokenizer and is_hub_name(model.tokenizer):
        refs.append(HubRef("model.tokenizer", ("model",), model, "tokenizer", "tokenizer_revision", "model"))
    for role in ("train", "eval"):
        for i, source in enumerate(getattr(recipe.data, role) or []):
            if source.path and is_hub_name(source.path):
                refs.append(HubRef(f"data.{role}[{i}]", ("data", role, i), source, "path", "revision", "dataset"))
    grpo = getattr(recipe, "grpo", None)
    for i, reward in enumerate(getattr(grpo, "rewards", None) or []):
        if getattr(reward, "kind", None) == "model" and is_hub_name(reward.path):
            refs.append(HubRef(f"grpo.rewards[{i}]", ("grpo", "rewards", i), reward, "path", "revision", "model"))
    distill = getattr(recipe, "distill", None)
    if recipe.task == "distill" and distill is not None and distill.teacher and is_hub_name(distill.teacher):
        refs.append(HubRef("distill.teacher", ("distill",), distill, "teacher", "teacher_revision", "model"))
    return refs


def pin(recipe, recorded: dict | None = None, handoff: Path | None = None, leads: bool = True, timeout_s=1800.0):
    """A copy of `recipe` with every hub name's revision set to the commit it reads.

    `leads`: this process fetches (one per node) and, given a `handoff` file, writes the
    commits (or its one-line refusal) there for the node's other processes, which wait for it
    (files only: no process group exists yet, so no collective can time out) and then read
    the same snapshots from the cache. `recorded`: the recipe.yaml of the run being resumed,
    whose commits are kept; a branch or tag that moved since is refused unless the recipe
    names the new commit."""
    recipe = recipe.model_copy(deep=True)
    refs = hub_refs(recipe)
    if not refs:
        return recipe
    if not leads and handoff is not None:
        commits = _wait_for_leader(handoff, [getattr(r.owner, r.name_field) for r in refs], timeout_s)
    else:
        if handoff is not None:
            handoff.unlink(missing_ok=True)  # a killed job's of the same id
        try:
            commits = [_commit(ref, recorded, cached_only=not leads) for ref in refs]
        except HubError as e:
            if handoff is not None:
                write_atomic(handoff, json.dumps({"error": str(e)}))
            raise
        if handoff is not None:
            write_atomic(handoff, json.dumps({"commits": commits}))
    for ref, commit in zip(refs, commits):
        # The pinned commit replaces the revision in this copy (assignment is not validated: it is a str).
        object.__setattr__(ref.owner, ref.revision_field, commit)
    return recipe


def _commit(ref: HubRef, recorded: dict | None, cached_only: bool) -> str:
    """The commit `ref` reads: the recipe's revision, else the resumed run's, else main."""
    name = getattr(ref.owner, ref.name_field)
    asked = getattr(ref.owner, ref.revision_field)
    before = _recorded_commit(recorded, ref, name)
    commit = snapshot(name, asked if asked is not None else before, ref.repo_type, ref.key, cached_only).name
    if before is not None and commit != before and asked != commit:
        raise HubError(
            f"{ref.key}: {name} revision {asked!r} is now commit {commit}, and the run being resumed read "
            f"{before}; set {_field(ref)}: {before} to continue on it, or {_field(ref)}: {commit} to switch"
        )
    return commit


def _field(ref: HubRef) -> str:
    if ref.key == "distill.teacher":
        return "distill.teacher_revision"
    return f"{'model' if ref.key.startswith('model.') else ref.key}.{ref.revision_field}"


def _recorded_commit(recorded: dict | None, ref: HubRef, name: str) -> str | None:
    """The commit the resumed run read for this field, when it named the same repository."""
    node: Any = recorded
    for step in ref.place:
        if isinstance(step, int):
            node = node[step] if isinstance(node, list) and step < len(node) else None
        else:
            node = node.get(step) if isinstance(node, dict) else None
    if not isinstance(node, dict) or node.get(ref.name_field) != name:
        return None
    commit = node.get(ref.revision_field)
    return commit if isinstance(commit, str) and _COMMIT.fullmatch(commit) else None


def _wait_for_leader(handoff: Path, names: list[str], timeout_s: float) -> list[str]:
    """The commits this node's first process pinned, once it has fetched them (or its refusal)."""
    deadline = time.monotonic() + timeout_s
    print(f"accord: waiting for this node's first process to fetch {', '.join(names)}…", file=sys.stderr, flush=True)
    while not handoff.is_file():
        if time.monotonic() > deadline:
            raise HubError(
                f"{', '.join(names)}: not fetched by this node's first process within data.prepare_timeout_s="
                f"{timeout_s:g} s; is it stuck, or the download very large? raise data.prepare_timeout_s"
            )
        time.sleep(0.5)
    outcome = json.loads(handoff.read_text(encoding="utf-8"))
    if "error" in outcome:
        raise HubError(outcome["error"])
    return outcome["commits"]
