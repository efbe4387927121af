"""Raw rows -> token columns, once: cached on disk under a fingerprint of (data files,
tokenizer, task settings), prepared by one process (with its own pool of tokenizing
workers) while the others wait for it.

The launcher (or `accord prepare`) prepares before any worker starts, so bad data stops
the run early with one line; under an outer launcher local rank 0 prepares and the other
ranks wait (with data.prepare_timeout_s, not a silent collective timeout), then everyone
memory-maps the same files: token shards (shards.py; columns.py for classify, dpo and
reward), Arrow for grpo (its rewards read raw columns) and sft's held-out rows. A
preparation that is killed keeps its finished chunks in `<cache>.partial` and the next one
continues from them (chunks.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accord.compat.datasets import fingerprint as dataset_fingerprint
from accord.data.chunks import default_workers, tokenise_share, write_shards
from accord.data.columns import COLUMNS_META, ColumnShards
from accord.data.nodeshare import NodeShare, claim_seal, node_share
from accord.data.packing import rows_folder, write_rows
from accord.data.rows import DataError, row_origin
from accord.data.shards import META, TokenShards
from accord.data.split import load_split
from accord.data.streams import check_task, is_stream, read_into_arrow
from accord.observe.progress import item_bar
from accord.recipe.hub import is_hub_name
from accord.recipe.paths import PathError, resolve_path
from accord.recipe.schema import DataConfig

# Bump when the cached columns change meaning (2: DPO keeps BOS on cut prompts; 3: BOS follows
# data.add_bos; 4: integer class labels are their own ids, eval_fraction over documents by text;
# 5: causal-LM training data as token shards, pre-training blocks cut from one stream;
# 6: a text file is read in pieces of PIECE_CHARS, which a held-out cut may now fall between;
# 7: classify, dpo and reward as multi-column token shards, sft's packed rows stored with its shards).
FORMAT_VERSION = 7
_DONE = "done.json"
_FILES = "row-files"  # per data fingerprint: the files its rows name (_row_files)
_ANNOUNCED: set[Path] = set()  # caches this process said it reuses (the checks, then the run)


@dataclass
class PreparedData:
    train: Any  # TokenShards (causal-LM tasks), ColumnShards (classify, dpo, reward) or a datasets.Dataset
    eval: Any | None
    report: dict[str, Any]  # counts (examples, truncated, dropped) and the task's learned state


def prepare_data(
    data: DataConfig, seed: int, tokenizer, task, preparer: bool, share: NodeShare | None = None
) -> PreparedData:
    """The encoded data of the recipe's data section (`seed`: the recipe's, which splits and
    mixes it), preparing it here when `preparer` and not cached. `share`: this node's place
    among the nodes preparing it (default: from the environment)."""
    folder = cache_folder(data, seed, tokenizer, task)
    if not (folder / _DONE).exists():
        if preparer:
            _prepare_into(folder, data, seed, tokenizer, task, share or node_share())
        else:
            _wait_for(folder, data.prepare_timeout_s)
    elif preparer and folder not in _ANNOUNCED:
        print(f"accord: reusing the prepared data in {folder}", file=sys.stderr, flush=True)
        _ANNOUNCED.add(folder)
    return _load(folder, task, tokenizer)


def cache_folder(data: DataConfig, seed: int, tokenizer, task) -> Path:
    root = Path(os.path.expanduser(data.cache_dir))
    key = fingerprint(data, seed, tokenizer, task)
    files = _row_files(root / _FILES / f"{task.name}-{key}.json", data, seed, task)
    if files:
        key = hashlib.sha256(f"{key}:{_stamps(files)}".encode()).hexdigest()[:16]
    return root / f"{task.name}-{key}"


def _row_files(record: Path, data: DataConfig, seed: int, task) -> list[str]:
    """The files the rows name (task.row_files: a vision-language row's images). They are a
    function of the data files, which the fingerprint `record` is named by already covers, so
    they are read from the rows once and recorded: later runs only stat them."""
    if task.row_files is None:
        return []
    if record.is_file():
        return json.loads(record.read_text())
    check_task(data, task)
    train, eval_ds = load_split(data, seed, task.text_fields)
    files = sorted({str(Path(f).absolute()) for ds in (train, eval_ds) if ds is not None for f in task.row_files(ds)})
    record.parent.mkdir(parents=True, exist_ok=True)
    tmp = record.with_name(f".{record.name}.{socket.gethostname()}-{os.getpid()}")  # several may write it
    tmp.write_text(json.dumps(files))
    os.replace(tmp, record)
    return files


def _stamps(files: list[str]) -> str:
    """Each file's size and mtime (stat only, as for the data files); a missing one as such
    (the task's row checks refuse it before anything is prepared)."""
    out = []
    for file in files:
        try:
            stat = os.stat(file)
        except OSError:
            out.append(f"{file}:missing")
            continue
        out.append(f"{file}:{stat.st_size}:{stat.st_mtime_ns}")
    return "\n".join(out)


def fingerprint(data: DataConfig, seed: int, tokenizer, task) -> str:
    """Changes whenever the encoded data could: source files (path, size, mtime), data
    settings, seed (splits and mixing), tokenizer (vocabulary, specials, chat template)
    and the task's own settings."""
    settings = data.model_dump(
        mode="json", exclude={"cache_dir", "prepare_timeout_s", "prepare_workers", "shuffle", "group_by_length"}
    )
    settings.pop("packing")  # applied after the cache; a task whose encoding depends on it says so in settings()
    h = hashlib.sha256()
    h.update(
        json.dumps(
            {
                "v": FORMAT_VERSION,
                "task": f"{type(task).__module__}:{type(task).__qualname__}",
                "settings": task.settings(),
                "data": settings,
                "seed": seed,
            },
            sort_keys=True,
        ).encode()
    )
    h.update(_tokenizer_identity(tokenizer).encode())
    for source in (data.train or []) + (data.eval or []):
        if source.function is not None:
            from accord.data.streams import function_identity

            h.update(function_identity(source.function).encode())
            continue
        if is_hub_name(source.path):
            continue  # its pinned commit (in the settings above) names its content
        try:
            path = resolve_path(source.path)
        except PathError as e:
            raise DataError(str(e)) from None
        for file in _source_files(path):
            stat = file.stat()
            h.update(f"{file}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _tokenizer_identity(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = _backend_json(backend) if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    extra = {
        "class": type(tokenizer).__name__,
        "special": tokenizer.special_tokens_map,
        "chat": tokenizer.chat_template,
    }
    return hashlib.sha256((body + json.dumps(extra, sort_keys=True, default=str)).encode()).hexdigest()


def _backend_json(backend) -> str:
    """The backend's description without its truncation and padding state, which a call
    such as `tokenizer(texts, truncation=True)` (classify's encoding) leaves set on it."""
    state = json.loads(backend.to_str())
    state["truncation"] = state["padding"] = None
    return json.dumps(state, sort_keys=True)


def _source_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return []


def _prepare_into(folder: Path, data: DataConfig, seed: int, tokenizer, task, share: NodeShare) -> None:
    import datasets

    datasets.disable_progress_bars()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{socket.gethostname()}-{os.getpid()}")  # nodes may share the folder
    work = folder.with_name(folder.name + ".partial")  # finished chunks, kept if this is killed
    shutil.rmtree(tmp, ignore_errors=True)
    _failed(folder).unlink(missing_ok=True)
    try:
        check_task(data, task)
        train, eval_ds = load_split(data, seed, task.text_fields)
        train, eval_ds = task.fit(train, eval_ds)
        workers = data.prepare_workers or default_workers()
        shared = share.nodes > 1 and task.token_shards
        if shared and not _tokenise_share(folder, work, train, eval_ds, task, workers, share):
            _wait_for(folder, data.prepare_timeout_s)  # another node seals the cache
            return
        tmp.mkdir()
        if task.token_shards:
            train_report = write_shards(
                train,
                task,
                data,
                "train",
                tmp / "train",
                work / "train",
                _tokenizer_identity(tokenizer),
                workers,
                quiet=shared,
            )
            if task.row_capacity:  # packed once here, mapped by every rank (packing.py)
                write_rows(TokenShards(tmp / "train"), task.row_capacity, rows_folder(tmp / "train", task.row_capacity))
        else:
            train, train_report = _encode(train, task, data, "train", folder.name)
            train.save_to_disk(str(tmp / "train"))
        if eval_ds is not None and task.eval_shards:  # no raw columns needed: shards too
            eval_report = write_shards(
                eval_ds,
                task,
                data,
                "eval",
                tmp / "eval",
                work / "eval",
                _tokenizer_identity(tokenizer),
                workers,
                quiet=shared,
            )
            eval_count = eval_report["eval_examples"]
        elif eval_ds is not None:
            if is_stream(eval_ds):  # sft's generation metrics read raw eval rows
                eval_ds = read_into_arrow(eval_ds, work / "eval-rows")
            eval_ds, _ = _encode(eval_ds, task, data, "eval", folder.name, keep_raw=True)
            eval_ds.save_to_disk(str(tmp / "eval"))
            eval_count = len(eval_ds)
        report = train_report | {"eval_examples": eval_count if eval_ds is not None else 0, "task_state": task.state()}
        (tmp / _DONE).write_text(json.dumps(report))
        if (folder / _DONE).exists():  # another node prepared the same data meanwhile: keep theirs
            shutil.rmtree(tmp)
        else:
            shutil.rmtree(folder, ignore_errors=True)  # an unfinished attempt
            os.rename(tmp, folder)
        shutil.rmtree(work, ignore_errors=True)
    except DataError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)  # the data must change: its chunks are of no use
        _failed(folder).write_text(str(e))  # waiting ranks stop with the same message
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _tokenise_share(folder: Path, work: Path, train, eval_ds, task, workers: int, share: NodeShare) -> bool:
    """Tokenise with the other nodes (nodeshare.py); whether this node then seals the cache."""

    def sealed() -> bool:
        return (folder / _DONE).exists() or _failed(folder).exists()

    tokenise_share(train, task, "train", work / "train", workers, share, sealed)
    if eval_ds is not None and task.eval_shards:
        tokenise_share(eval_ds, task, "eval", work / "eval", workers, share, sealed)
    return not sealed() and claim_seal(work)


def _encode(ds, task, data: DataConfig, split: str, key: str, keep_raw: bool = False):
    """Encode, then apply data.truncation; returns (dataset, counts). `key`: the cache
    folder's name, which changes whenever the encoding could."""
    raw_columns = ds.column_names
    # A bar over the examples (shown once tokenizing takes over ~3 s); datasets' own bars are off.
    with item_bar(len(ds), f"tokenize {split}") as bar:

        def encode(batch: dict[str, list]) -> dict[str, list]:
            out = task.encode_batch(batch)
            bar.update(len(next(iter(batch.values()))))
            return out

        # The fingerprint is given: datasets would otherwise try to hash the bar with the function.
        token = hashlib.sha256(f"{dataset_fingerprint(ds)}:{split}:{key}".encode()).hexdigest()[:16]
        encoded = ds.map(encode, batched=True, desc=f"tokenize {split}", new_fingerprint=token)
    policy = data.truncation
    over = [i for i, flag in enumerate(encoded["over_length"]) if flag] if "over_length" in encoded.column_names else []
    if over and policy == "error":
        raise DataError(
            f"{row_origin(ds[over[0]])}: {len(over)} {split} example(s) are longer than data.max_length="
            f"{data.max_length} tokens (this one first); raise max_length or set data.truncation=truncate|drop"
        )
    over_set = set(over)
    drop = set(over_set) if policy == "drop" else set()
    empty = [i for i, n in enumerate(encoded["num_targets"]) if n == 0] if "num_targets" in encoded.column_names else []
    for i in empty:
        if i in drop:
            continue
        if i in over_set:
            drop.add(i)  # truncation cut every target token away: nothing to learn from it
            continue
        raise DataError(
            f"{row_origin(ds[i])}: this example has no target tokens (nothing to train on); fix or remove it"
        )
    if drop:
        encoded = encoded.select([i for i in range(len(encoded)) if i not in drop])
    if not keep_raw:
        encoded = encoded.remove_columns([c for c in raw_columns if c in encoded.column_names])
    encoded = task.regroup(encoded)
    if len(encoded) == 0:
        raise DataError(f"no {split} examples left after data.truncation={policy} (data.max_length={data.max_length})")
    counts = {f"{split}_examples": len(encoded), f"{split}_over_length": len(over), f"{split}_dropped": len(drop)}
    return encoded, counts


def _failed(folder: Path) -> Path:
    return folder.with_name(folder.name + ".failed")


def _wait_for(folder: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not (folder / _DONE).exists():
        if _failed(folder).exists():
            raise DataError(_failed(folder).read_text())
        if time.monotonic() > deadline:
            raise DataError(
                f"the data was not prepared within data.prepare_timeout_s={timeout_s:g} s (waiting for {folder}); "
                f"is the first process stuck, or is the data very large? raise data.prepare_timeout_s"
            )
        time.sleep(0.5)


def _load(folder: Path, task, tokenizer) -> PreparedData:
    report = json.loads((folder / _DONE).read_text())
    task.load_state(report["task_state"])
    return PreparedData(_load_split(folder / "train", tokenizer), _load_split(folder / "eval", tokenizer), report)


def _load_split(folder: Path, tokenizer):
    """Token shards, or (other tasks) an Arrow dataset: `datasets` is imported only then
    (seconds of a resume that token shards do not need)."""
    if (folder / META).exists():
        return TokenShards(folder, _tokenizer_identity(tokenizer))
    if (folder / COLUMNS_META).exists():
        return ColumnShards(folder, _tokenizer_identity(tokenizer))
    if not folder.exists():
        return None
    import datasets

    return datasets.load_from_disk(str(folder))


def reads_datasets(data: DataConfig, task_class) -> bool:
    """Whether loading the prepared data of this data section imports datasets: a task that
    keeps its rows as datasets, or held-out data (kept with its raw columns unless the task
    streams text)."""
    held_out = (
        data.eval is not None
        or data.eval_fraction > 0
        or (data.generate is not None and data.generate.eval_examples > 0)
    )
    return not task_class.token_shards or (held_out and not task_class.eval_shards)
