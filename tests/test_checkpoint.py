"""The checkpoint folder protocol and resume rules, without starting processes."""

from __future__ import annotations

import json
import os

from accord.checkpoint.resume import identity_changes
from accord.checkpoint.store import COMPLETE, complete_checkpoints, incomplete_checkpoints, prune
from accord.observe.metrics import MetricsWriter, read_metrics
from accord.recipe.schema import validate_recipe
from conftest import TINY_RECIPE


def _fake_checkpoint(root, step, complete=True):
    folder = root / f"step-{step:06d}"
    folder.mkdir(parents=True)
    if complete:
        (folder / COMPLETE).write_text("")
    return folder


def test_only_sealed_checkpoints_count_and_the_rest_are_reported(tmp_path):
    _fake_checkpoint(tmp_path, 10)
    _fake_checkpoint(tmp_path, 20, complete=False)  # a crash before sealing
    (tmp_path / ".tmp-step-000030").mkdir()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000010"]
    assert [p.name for p in incomplete_checkpoints(tmp_path)] == [".tmp-step-000030", "step-000020"]


def test_prune_keeps_the_newest_complete_ones(tmp_path):
    for step in (5, 10, 15, 20):
        _fake_checkpoint(tmp_path, step)
    prune(tmp_path, keep_last=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000015", "step-000020"]


def test_prune_keeps_the_checkpoint_just_sealed_and_leaves_later_ones(tmp_path):
    """A run resumed from step 10 (step 30 skipped: damaged) seals step 20: later checkpoints
    are neither counted nor removed, so the one just written is never pruned for them."""
    for step in (10, 20, 30):
        _fake_checkpoint(tmp_path, step)
    prune(tmp_path, keep_last=1, sealed=tmp_path / "step-000020")
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-000020", "step-000030"]


def _manifested_checkpoint(folder, files: dict[str, tuple[bytes, int]]):
    """A checkpoint folder whose files (name -> (bytes, writing rank)) are recorded in its manifest."""
    from accord.checkpoint.manifest import file_entries, write_manifest

    entries = {}
    for name, (data, rank) in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
        entries |= file_entries(folder, [name], rank)
    write_manifest(folder, entries)
    return folder


def test_verify_names_changed_bytes_a_wrong_size_and_a_missing_file_with_its_writer(tmp_path):
    from accord.checkpoint.manifest import verify

    files = {
        "state/__0_0.distcp": (b"a" * 4096, 0),
        "state/__1_0.distcp": (b"b" * 4096, 1),
        "schedule.pt": (b"c" * 10, 0),
    }
    folder = _manifested_checkpoint(tmp_path / "step-000001", files)
    assert verify(folder) == []
    (folder / "state" / "__0_0.distcp").write_bytes(b"a" * 4095 + b"x")  # same length
    assert verify(folder, checksums=False) == []  # sizes only: what the launcher checks
    assert verify(folder) == [
        "state/__0_0.distcp does not match its sha256 checksum (its bytes changed after it was written)"
    ]
    (folder / "schedule.pt").write_bytes(b"c" * 1234)
    (folder / "state" / "__1_0.distcp").unlink()
    problems = verify(folder, checksums=False)
    assert problems[0] == "schedule.pt is 1,234 bytes, expected 10"
    assert problems[1].startswith("state/__1_0.distcp (written by rank 1) is missing on this node")


def test_each_rank_verifies_the_files_its_rank_number_wrote(tmp_path):
    """Resumed on 2 ranks, a checkpoint of 4: rank 1 checks what ranks 1 and 3 wrote."""
    from accord.checkpoint.manifest import verify

    files = {f"state/__{r}_0.distcp": (bytes([r]) * 64, r) for r in range(4)}
    folder = _manifested_checkpoint(tmp_path / "step-000001", files)
    for r in range(4):
        (folder / "state" / f"__{r}_0.distcp").unlink()
    assert [p.split(" ")[0] for p in verify(folder, rank=1, world=2)] == ["state/__1_0.distcp", "state/__3_0.distcp"]
    assert [p.split(" ")[0] for p in verify(folder, rank=0, world=2)] == ["state/__0_0.distcp", "state/__2_0.distcp"]


def test_identity_changes_name_the_field_and_ignore_safe_ones():
    saved = validate_recipe(TINY_RECIPE).model_dump(mode="json")
    safe = TINY_RECIPE | {"train": TINY_RECIPE["train"] | {"max_steps": 99, "log_every": 1}}
    safe["batch"] = TINY_RECIPE["batch"] | {"micro_batch_size": 4}
    # Another machine's cache folder and preparing processes: the same rows.
    safe["data"] = TINY_RECIPE["data"] | {"cache_dir": "/elsewhere/cache", "prepare_workers": 3}
    assert identity_changes(saved, validate_recipe(safe)) == []
    model = TINY_RECIPE["model"] | {"config": TINY_RECIPE["model"]["config"] | {"hidden_size": 64}}
    changed = TINY_RECIPE | {"model": model, "batch": {"global_batch_size": 64}}
    assert identity_changes(saved, validate_recipe(changed)) == [
        "model.config.hidden_size (checkpoint: 32, recipe: 64)",
        "batch.global_batch_size (checkpoint: 32, recipe: 64)",
    ]


def test_resumed_metrics_drop_the_steps_trained_again(tmp_path):
    lines = [{"kind": "train", "step": s, "loss": 1.0} for s in range(1, 9)] + [
        {"kind": "eval", "step": 8, "loss": 1.0}
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    writer = MetricsWriter(tmp_path, resume_step=5)
    writer.write({"kind": "train", "step": 6, "loss": float("nan")})
    writer.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["loss"] is None  # strict JSON for a non-finite value


def test_a_failed_checkpoint_names_the_first_ranks_own_error_not_dcps_wrapper():
    from torch.distributed.checkpoint.api import CheckpointException

    from accord.checkpoint.store import _reason

    failures = {1: (RuntimeError("bad shard"), None), 0: (ValueError("unexpected  pos\n704"), None)}
    assert _reason(CheckpointException("save failed", failures)) == "rank 0: ValueError: unexpected pos 704"
    wrapped = CheckpointException("save failed", {0: (OSError(28, "No space left on device", "/x/y"), None)})
    assert _reason(wrapped) == "No space left on device (/x/y)"


def test_disk_space_warning_when_checkpoints_would_not_fit(tmp_path):
    from accord.checkpoint.disk_space import disk_space_warning

    assert disk_space_warning(tmp_path, params=1000, trained=1000, keep_last=2) is None
    warning = disk_space_warning(tmp_path, params=10**15, trained=10**15, keep_last=2)
    assert warning and "3 checkpoints" in warning and "GiB free" in warning
    # fp32 weights, and AdamW's two moments for the trained parameters only (an adapter's few)
    assert "~1.00 GiB each" in disk_space_warning(tmp_path, params=2**28, trained=0, keep_last=2**40)
    assert "~3.00 GiB each" in disk_space_warning(tmp_path, params=2**28, trained=2**28, keep_last=2**40)


# ---------------------------------------------------------------- export without a full gather


def _tiny_llama(tie: bool = False):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config)


def test_streamed_export_writes_transformers_shards_that_load(tmp_path):
    """Tensors handed over one at a time become model-0000k-of-0000n.safetensors files of at
    most the shard size plus their index; from_pretrained loads them, a tied weight included."""
    import torch
    from transformers import AutoModelForCausalLM

    from accord.engine.base import unique_entries
    from accord.models.build import build_byte_tokenizer
    from accord.output.folder import save_streamed_model
    from conftest import read_safetensors_folder

    model = _tiny_llama(tie=True)
    tensors = ((name, t.detach().clone()) for name, t in unique_entries(model))
    save_streamed_model(tensors, model, build_byte_tokenizer(), tmp_path / "final", shard_bytes=8_000)
    index = json.loads((tmp_path / "final" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert "lm_head.weight" not in index["weight_map"]  # tied: saved once, as save_pretrained does
    assert all((tmp_path / "final" / s).stat().st_size < 8_000 + 4_096 for s in shards)  # the shard size, plus a header
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32)
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert set(read_safetensors_folder(tmp_path / "final")) == set(index["weight_map"])


def test_lora_merged_per_layer_equals_peft_merge_and_unload():
    """merged_lora, fed one tensor at a time, gives peft's merge_and_unload weights and names."""
    import torch
    from peft import LoraConfig, get_peft_model

    from accord.engine.base import unique_entries
    from accord.output.export import merged_lora

    peft_model = get_peft_model(_tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_()  # peft starts B at zero: make the merge matter
    merged = dict(merged_lora(((n, t.detach().clone()) for n, t in unique_entries(peft_model)), peft_model))
    expected = peft_model.merge_and_unload().state_dict()
    assert merged.keys() == expected.keys()
    assert max((merged[k] - expected[k]).abs().max().item() for k in expected) < 1e-6


# ---------------------------------------------------------------- a damaged sharded state


def test_state_problems_name_a_missing_or_truncated_file(tmp_path):
    import torch

    from accord.engine.state import state_problems, write_sharded

    folder = tmp_path / "step-000001"
    write_sharded({"model": {"w": torch.ones(64, 64)}, "optim": {}}, folder)
    assert state_problems(folder) == []
    (shard,) = (folder / "state").glob("*.distcp")
    os.truncate(shard, 100)
    (problem,) = state_problems(folder)
    assert str(shard) in problem and "truncated" in problem
    shard.unlink()
    (problem,) = state_problems(folder)
    assert str(shard) in problem and "missing" in problem


def test_a_checkpoint_without_manifest_is_checked_against_its_index(tmp_path):
    """Written before manifests existed: verified as before, every shard as long as DCP's index says."""
    import torch

    from accord.checkpoint.manifest import verify
    from accord.engine.state import write_sharded

    folder = tmp_path / "step-000001"
    write_sharded({"model": {"w": torch.ones(64, 64)}, "optim": {}}, folder)
    assert verify(folder) == []
    (shard,) = (folder / "state").glob("*.distcp")
    os.truncate(shard, 100)
    (problem,) = verify(folder)
    assert str(shard) in problem and "truncated" in problem
    assert verify(folder, rank=1, world=2) == []  # rank 0 alone checks an old checkpoint


def test_a_field_added_since_the_checkpoint_is_no_identity_change():
    from accord.recipe.schema import validate_recipe
    from conftest import TINY_RECIPE

    recipe = validate_recipe(TINY_RECIPE)
    saved = recipe.model_dump(mode="json")
    del saved["data"]["add_bos"]  # written by a version without the field
    assert identity_changes(saved, recipe) == []
    saved["seed"] = 8
    assert identity_changes(saved, recipe) == ["seed (checkpoint: 8, recipe: 7)"]


def test_a_checkpoint_taken_in_another_data_order_is_refused_in_one_line(tmp_path):
    from dataclasses import asdict

    from accord.checkpoint.resume import order_change
    from accord.checkpoint.store import STATE_FILE, TrainingState
    from accord.data.order import ORDER_VERSION

    recipe = validate_recipe(TINY_RECIPE)
    folder = tmp_path / "step-000004"
    folder.mkdir()
    state = asdict(TrainingState(4, 0, 128, 2, 8, ORDER_VERSION))
    (folder / STATE_FILE).write_text(json.dumps(state))
    assert order_change(folder, recipe) is None
    del state["data_order"]  # written before the order was recorded: a stored numpy permutation
    (folder / STATE_FILE).write_text(json.dumps(state))
    line = order_change(folder, recipe)
    assert line is not None and "\n" not in line and str(folder) in line and "another data order" in line
    unshuffled = validate_recipe(TINY_RECIPE | {"data": TINY_RECIPE["data"] | {"shuffle": False}})
    assert order_change(folder, unshuffled) is None  # the file order never changed


def test_a_state_written_in_bounded_parts_reads_back_as_one_write(tmp_path):
    """DeepSpeed's save gathers whole tensors: it writes them in parts (save_parts: no rank
    keeps more than the budget, or one tensor), one DCP call each, under one index that every
    reader (read_whole: DeepSpeed; read_into: the torch strategies) reads as a single write."""
    import torch

    from accord.engine.state import (
        MODEL,
        OPTIM,
        SaveEntry,
        read_into,
        read_whole,
        save_parts,
        state_problems,
        stored_keys,
        write_in_parts,
        write_sharded,
    )

    generator = torch.Generator().manual_seed(0)
    shapes = {"embed": (8, 16), "a": (16, 16), "b": (16,), "c": (32, 16), "head": (4, 16)}
    model = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    optim = {
        name: {
            "exp_avg": torch.randn(shape, generator=generator),
            "exp_avg_sq": torch.rand(shape, generator=generator),
            "step": torch.tensor(3.0),
        }
        for name, shape in shapes.items()
    }
    entries = [SaveEntry(MODEL, name, 4 * tensor.numel()) for name, tensor in model.items()]
    entries += [SaveEntry(OPTIM, name, 8 * model[name].numel()) for name in model]
    budget = 3 * 4 * 16 * 16
    for world in (1, 3):
        planned = save_parts(entries, world, budget)
        assert [(owner, entry) for part in planned for owner, entry in part] == [
            (i % world, e) for i, e in enumerate(entries)
        ]  # in order, round-robin
        for part, rank in ((part, rank) for part in planned for rank in range(world)):
            held = [entry.nbytes for owner, entry in part if owner == rank]
            assert len(held) <= 1 or sum(held) <= budget
    parts = save_parts(entries, 1, budget)
    assert len(parts) > 2 and len(save_parts(entries, 1, None)) == 1

    def part_states():
        for part in parts:
            yield {
                MODEL: {e.name: model[e.name] for _, e in part if e.kind == MODEL},
                OPTIM: {e.name: optim[e.name] for _, e in part if e.kind == OPTIM},
            }

    streamed, whole = tmp_path / "parts", tmp_path / "whole"
    write_in_parts(part_states(), streamed).result()
    write_sharded({MODEL: model, OPTIM: optim}, whole).result()
    assert state_problems(streamed) == []
    assert len(list((streamed / "state").glob("*.distcp"))) == len(parts)
    assert stored_keys(streamed) == stored_keys(whole)
    keys = list(stored_keys(whole))
    read = {key: value for batch in read_whole(streamed, keys, stored_keys(streamed)) for key, value in batch.items()}
    expected = {key: value for batch in read_whole(whole, keys, stored_keys(whole)) for key, value in batch.items()}
    assert read.keys() == expected.keys() and all(torch.equal(read[key], expected[key]) for key in keys)
    into = {
        MODEL: {name: torch.zeros_like(t) for name, t in model.items()},
        OPTIM: {name: {k: torch.zeros_like(v) for k, v in o.items()} for name, o in optim.items()},
    }
    read_into(into, streamed)
    assert all(torch.equal(into[MODEL][name], model[name]) for name in model)
    assert all(torch.equal(into[OPTIM][name][k], optim[name][k]) for name in optim for k in optim[name])


def test_a_zero3_rank_reads_the_rows_around_its_partition_in_bounded_batches(tmp_path, monkeypatch):
    """DeepSpeed ZeRO-3's load: each rank asks for its flat partition of every tensor
    (read_flat_ranges) and gets exactly those elements, reading only the rows that cover them,
    a batch of at most READ_BUFFER_BYTES (or one range) at a time."""
    import math

    import torch

    from accord.engine import state as engine_state
    from accord.engine.state import MODEL, read_flat_ranges, stored_keys, write_sharded

    generator = torch.Generator().manual_seed(0)
    shapes = {"embed": (13, 16), "a": (16, 16), "norm": (16,), "conv": (5, 3, 4), "tiny": (2,)}
    model = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    write_sharded({MODEL: model}, tmp_path).result()
    stored = stored_keys(tmp_path)
    budget = 4 * 16 * 16
    monkeypatch.setattr(engine_state, "READ_BUFFER_BYTES", budget)
    batches: list[dict[str, torch.Size]] = []
    real_read = engine_state._read
    monkeypatch.setattr(
        engine_state,
        "_read",
        lambda folder, batch, planner=None: (
            batches.append({k: v.shape for k, v in batch.items()}) or real_read(folder, batch, planner)
        ),
    )
    for world in (1, 3, 4):
        pieces: dict[str, list[torch.Tensor]] = {name: [] for name in model}
        for rank in range(world):
            ranges = {}
            for name, tensor in model.items():
                size = -(-tensor.numel() // world)  # DeepSpeed's partition (the last one padded)
                start = min(rank * size, tensor.numel())
                if min(start + size, tensor.numel()) > start:
                    ranges[f"{MODEL}.{name}"] = (start, min(start + size, tensor.numel()))
            batches.clear()
            for batch in read_flat_ranges(tmp_path, ranges, stored):
                for key, value in batch.items():
                    pieces[key.removeprefix(f"{MODEL}.")].append(value)
            for batch in batches:
                held = [4 * math.prod(shape) for shape in batch.values()]
                assert len(held) == 1 or sum(held) <= budget
                for key, shape in batch.items():  # the rows around the range: at most one partial row each side
                    start, stop = ranges[key]
                    row = math.prod(shape[1:]) if len(shape) > 1 else 1
                    assert shape[1:] == model[key.removeprefix(f"{MODEL}.")].shape[1:] and shape[
                        0
                    ] * row <= stop - start + 2 * (row - 1)
        for name, tensor in model.items():
            assert torch.equal(torch.cat(pieces[name]), tensor.flatten()), (world, name)


def test_a_model_of_one_shard_is_one_model_safetensors_as_save_pretrained_writes_it(tmp_path):
    """Tools open `model.safetensors` by name: a final model that fits one shard has no index."""
    import torch
    from transformers import AutoModelForCausalLM

    from accord.engine.base import unique_entries
    from accord.models.build import build_byte_tokenizer
    from accord.output.folder import save_streamed_model

    model = _tiny_llama(tie=True)
    tensors = ((name, t.detach().clone()) for name, t in unique_entries(model))
    save_streamed_model(tensors, model, build_byte_tokenizer(), tmp_path / "final")
    reference = tmp_path / "reference"
    model.save_pretrained(reference)
    written = sorted(p.name for p in (tmp_path / "final").glob("model*"))
    assert written == sorted(p.name for p in reference.glob("model*")) == ["model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32)
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_streamed_export_writes_each_tensor_as_it_arrives_in_every_dtype(tmp_path):
    """The shard writer keeps no tensor once it has written it (its memory is one tensor,
    not one shard), and the files read back bit-exactly through safetensors in every dtype,
    a scalar and an empty tensor included."""
    import gc
    import weakref

    import torch
    from safetensors.torch import load_file

    from accord.output.safetensors_writer import SHARD_INDEX, ShardedSafetensorsWriter

    expected = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).bfloat16(),
        "f16": torch.randn(2, 2).half(),
        "i64": torch.arange(6).reshape(2, 3),
        "bool": torch.tensor([True, False, True]),
        "u8": torch.arange(9, dtype=torch.uint8),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(4, 6).t(),
    }
    writer = ShardedSafetensorsWriter(tmp_path, shard_bytes=64)
    handed = []
    for name, value in expected.items():
        tensor = value.clone()
        handed.append(weakref.ref(tensor))
        writer.add(name, tensor)
        del tensor
        gc.collect()
        assert all(ref() is None for ref in handed), f"the writer still holds a tensor after {name}"
    writer.close()
    index = json.loads((tmp_path / SHARD_INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in expected.values())
    loaded = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded |= load_file(tmp_path / shard)
    assert set(loaded) == set(expected) and not list(tmp_path.glob(".*"))  # no data file left behind
    for name, value in expected.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name
