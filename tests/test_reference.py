"""accord against code it did not write: a bare PyTorch loop over the same global batches.

accord trains from a model folder the test built with plain transformers, on 2 processes ×
4 sequences × 4 accumulation steps (fp32, no dropout). The loop below never touches
accord's trainer, engine or tasks: one forward over the whole global batch of unpacked
examples, loss = summed token cross-entropy / target tokens of the global batch,
clip_grad_norm_, torch's AdamW and transformers' cosine schedule. Only the token rows and
their order come from accord's data layer (what the run trained on). Both must end with
the same parameters; the common mean of micro-batch means must not — so the test can fail.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import (
    TINY_RECIPE,
    assert_ok,
    final_params,
    max_param_diff,
    read_safetensors_folder,
    run_accord,
    step_losses,
    write_recipe,
)

pytestmark = pytest.mark.distributed
TOLERANCE = 1e-5
STEPS = 8
WORLD, MICRO = 2, 4  # 32 sequences per step: 2 processes × 4 × 4 accumulation steps
WEIGHT_DECAY = 0.01


def _initial_model(folder: Path, vocab: dict[str, int]) -> None:
    """TINY_RECIPE's model built by transformers itself (seeded), saved as a model folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = {k: v for k, v in TINY_RECIPE["model"]["config"].items() if k != "architecture"}
    config = LlamaConfig(**settings, **vocab, attention_dropout=0.0)
    torch.manual_seed(1234)
    LlamaForCausalLM(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def accord_run(tmp_path_factory):
    from accord.models.build import build_byte_tokenizer

    root = tmp_path_factory.mktemp("reference")
    tokenizer = build_byte_tokenizer()
    vocab = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    _initial_model(root / "initial", vocab)
    raw = copy.deepcopy(TINY_RECIPE)
    raw["model"] = {"path": str(root / "initial"), "tokenizer": "byte"}
    raw["data"] |= {"cache_dir": str(root / "cache")}
    raw["batch"] = {"global_batch_size": 32, "micro_batch_size": MICRO}
    raw["optim"] |= {"weight_decay": WEIGHT_DECAY}
    raw["train"] = {"max_steps": STEPS, "log_every": 1}
    raw["engine"] |= {"processes": WORLD}
    out = root / "accord"
    proc = run_accord("train", write_recipe(root / "recipe.yaml", raw), f"output.dir={out}")
    assert_ok(proc)
    assert "accord: batch 2 processes × 4 sequences × 4 accumulation steps" in proc.stderr
    return raw, out, proc.stderr


def _global_batches(raw: dict, log: str) -> tuple[list[list[dict]], int]:
    """The examples of each step's global batch (grouped by the row accord packed them in),
    read through accord's data layer from the run's own cache; and the pad id."""
    from accord.data.order import GlobalOrder
    from accord.data.packing import Rows
    from accord.data.prepare import prepare_data
    from accord.models.build import build_tokenizer
    from accord.recipe.schema import validate_recipe
    from accord.tasks import build_task, task_config

    recipe = validate_recipe(raw)
    tokenizer = build_tokenizer(recipe.model)
    train = prepare_data(
        recipe.data, recipe.seed, tokenizer, build_task(task_config(recipe), tokenizer), preparer=True
    ).train
    rows = Rows.build(np.asarray(train["length"]), np.asarray(train["num_targets"]), recipe.data.max_length)
    assert f"in {len(rows)} packed rows" in log  # the rows the run trained on
    order = GlobalOrder(len(rows), recipe.batch.global_batch_size, recipe.seed)
    return [
        [[train[int(i)] for i in rows.members[r]] for r in order.batch(step)] for step in range(STEPS)
    ], tokenizer.pad_token_id


def bare_loop(folder: Path, batches: list[list[list[dict]]], pad_id: int, optim: dict, normalisation: str):
    """Plain transformers + torch: returns (final parameters, loss of each step)."""
    from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    params = list(model.parameters())
    groups = [  # no decay on 1-D tensors (norm weights), as customary
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=optim["lr"], betas=(0.9, 0.999), eps=1e-8)
    scheduler = get_cosine_schedule_with_warmup(optimizer, optim["warmup_steps"], STEPS)
    losses = []
    for rows in batches:
        examples = [e for row in rows for e in row]
        width = max(len(e["input_ids"]) for e in examples)
        ids = torch.tensor([e["input_ids"] + [pad_id] * (width - len(e["input_ids"])) for e in examples])
        labels = torch.tensor([e["labels"] + [-100] * (width - len(e["labels"])) for e in examples])
        mask = (torch.arange(width)[None, :] < torch.tensor([len(e["input_ids"]) for e in examples])[:, None]).long()
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        targets = labels[:, 1:]
        token_loss = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), targets, ignore_index=-100, reduction="none"
        )
        per_example_sum, per_example_count = token_loss.sum(1), (targets != -100).sum(1)
        global_loss = per_example_sum.sum() / per_example_count.sum()
        if normalisation == "global":
            loss = global_loss
        else:  # each micro-batch of MICRO rows: its own mean; then the mean of those means
            row_of = torch.tensor([r for r, row in enumerate(rows) for _ in row])
            micro_of = row_of // MICRO
            sums = torch.zeros(len(rows) // MICRO).index_add(0, micro_of, per_example_sum)
            counts = torch.zeros(len(rows) // MICRO).index_add(0, micro_of, per_example_count.float())
            loss = (sums / counts).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim["max_grad_norm"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(global_loss.item())
    return {k: v.detach() for k, v in model.state_dict().items()}, losses


def test_accord_ends_where_a_bare_pytorch_loop_ends(accord_run):
    raw, out, log = accord_run
    batches, pad_id = _global_batches(raw, log)
    folder = Path(raw["model"]["path"])
    accord_params = final_params(out)

    bare, bare_losses = bare_loop(folder, batches, pad_id, raw["optim"], "global")
    bare = {k: v for k, v in bare.items() if k in accord_params}
    diff = max_param_diff(accord_params, bare)
    logged = step_losses(out)
    loss_diff = max(abs(logged[s + 1] - bare_losses[s]) for s in range(STEPS))
    print(f"accord vs bare loop: max |Δparam| = {diff:.2e}, max |Δloss| = {loss_diff:.2e}")

    mean_of_means, _ = bare_loop(folder, batches, pad_id, raw["optim"], "mean_of_means")
    wrong = max_param_diff(accord_params, {k: v for k, v in mean_of_means.items() if k in accord_params})
    initial = max_param_diff(accord_params, {k: v for k, v in _load(folder).items() if k in accord_params})
    print(f"accord vs mean-of-means loop: max |Δparam| = {wrong:.2e}; accord's total movement {initial:.2e}")

    assert sorted(logged) == list(range(1, STEPS + 1)) and loss_diff <= TOLERANCE
    assert diff <= TOLERANCE
    assert wrong > 100 * TOLERANCE  # the comparison is sharp enough to catch the usual mistake
    assert initial > 100 * TOLERANCE  # and the weights moved


def _load(folder: Path) -> dict[str, torch.Tensor]:
    return read_safetensors_folder(folder)
