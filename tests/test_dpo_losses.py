"""dpo.loss_type: every loss equals TRL 1.16's DPOTrainer on the same tokens, step by step.

How: one DPOTrainer is built on a tiny Llama; for each configuration its attributes that
DPOConfig sets (loss_types, loss_weights, label_smoothing, discopop_tau) are set, and for 3
steps TRL's own `compute_loss` on the batch accord collates (completion_mask = accord's
labels) is compared with accord's loss_sum / pairs on a second copy of the same weights,
both given the reference log-probabilities of TRL's own reference pass; both copies then
take the same SGD step from their own gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import recipe_for, run_accord_here

CONFIGS = {name: {"loss_type": name} for name in ("sigmoid", "hinge", "ipo", "nca_pair", "bco_pair", "sppo_hard")}
CONFIGS |= {name: {"loss_type": name} for name in ("apo_zero", "apo_down", "discopop", "sigmoid_norm")}
CONFIGS |= {
    "robust": {"loss_type": "robust", "label_smoothing": 0.1},
    "exo_pair": {"loss_type": "exo_pair", "label_smoothing": 1e-3},
    "mixture": {"loss_type": ["sigmoid", "ipo", "bco_pair"], "loss_weights": [0.8, 0.2, 1.0]},
    "reference_free": {"loss_type": "sigmoid", "reference_free": True},
    "rpo_alpha": {"loss_type": "sigmoid", "rpo_alpha": 0.5},
}
# Chosen answers of one length per batch: where TRL's batch-wide token mean of the NLL (sft)
# and accord's per-answer mean agree; rejected lengths vary (ipo, sigmoid_norm normalise them).
BATCHES = [
    [("2+2=", "4!", "5"), ("what is red? ", "ok", "a small dog that sat"), ("hi", " t", "!!!")],
    [("1+1=", "22", "3"), ("x", "yz", "abcdef"), ("prompt ", "ab", "c")],
    [("9+9=", "18", "17!"), ("q? ", "no", "yes sir"), ("z", "aa", "b")],
]


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    pytest.importorskip("trl")
    import datasets
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    from accord.models.build import build_byte_tokenizer
    from conftest import TINY_RECIPE

    tokenizer = build_byte_tokenizer()
    settings = {k: v for k, v in TINY_RECIPE["model"]["config"].items() if k != "architecture"}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**settings, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id))
    initial = copy.deepcopy(model.state_dict())
    reference = copy.deepcopy(model)
    rows = datasets.Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in BATCHES[0]])
    args = DPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), report_to="none", use_cpu=True)
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, processing_class=tokenizer, train_dataset=rows)
    return trainer, initial, tokenizer, settings


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_loss_equals_trl_dpo_trainers_at_every_step(trl_trainer, tmp_path, name):
    from transformers import LlamaConfig, LlamaForCausalLM

    from accord.recipe.schema import validate_recipe
    from accord.tasks import build_task, task_config

    trainer, initial, tokenizer, settings = trl_trainer
    section = CONFIGS[name]
    recipe = validate_recipe(recipe_for("dpo", tmp_path) | {"dpo": section})
    task = build_task(task_config(recipe), tokenizer)
    ours = LlamaForCausalLM(LlamaConfig(**settings, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id))
    ours.load_state_dict(initial)
    task.configure_model(ours)
    theirs = trainer.model
    theirs.load_state_dict(initial)
    cfg = recipe.dpo
    terms = cfg.weighted_losses()
    trainer.loss_types, trainer.loss_weights = [t for t, _ in terms], [w for _, w in terms]
    trainer.label_smoothing, trainer.args.discopop_tau = cfg.label_smoothing, cfg.discopop_tau
    # The reference log-probabilities come from TRL's own reference pass (compute_ref_log_probs),
    # given to both: TRL's policy and reference passes differ numerically by more than 1e-5 even
    # where their weights are equal. reference_free: 0.
    trainer.precompute_ref_logps = True
    ours_opt, theirs_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, theirs))
    for rows in BATCHES:
        encoded = task.encode_batch({k: [r[i] for r in rows] for i, k in enumerate(("prompt", "chosen", "rejected"))})
        batch = task.collate([[{k: v[i] for k, v in encoded.items()}] for i in range(len(rows))])
        inputs = {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "completion_mask": (batch["labels"] != -100).long(),
        }
        if cfg.reference_free:
            ref = torch.zeros(len(rows)), torch.zeros(len(rows))
        else:
            ref = trainer.compute_ref_log_probs(trainer.ref_model, inputs)
        inputs |= {"ref_chosen_logps": ref[0], "ref_rejected_logps": ref[1]}
        batch["ref_logps"] = torch.cat(ref)
        out = task.loss(ours, batch)
        loss = out.loss_sum / out.num_targets
        trl_loss = trainer.compute_loss(theirs, inputs)
        # 1e-5, relative where a loss is above 1 (ipo and sppo_hard square margins of 1/beta)
        assert abs(loss.item() - trl_loss.item()) <= 1e-5 * max(1.0, abs(trl_loss.item())), (name, loss, trl_loss)
        for opt, value in ((ours_opt, loss), (theirs_opt, trl_loss)):
            opt.zero_grad()
            value.backward()
            opt.step()
    assert trl_loss.item() != 0.0


@pytest.mark.parametrize(
    "override, needle",
    [
        ("dpo.loss_type=sigmod", "dpo.loss_type: unknown loss 'sigmod' (valid: sigmoid, hinge, ipo,"),
        ("dpo.loss_type=aot", "dpo.loss_type=aot: it sorts the log-ratios"),
        ("dpo.loss_type=[sigmoid,ipo] dpo.loss_weights=[1.0]", "dpo.loss_weights has 1 weights for 2 loss types"),
        ("dpo.label_smoothing=0.1", "dpo.label_smoothing=0.1 has no effect"),
        ("dpo.loss_type=exo_pair", "exo_pair needs dpo.label_smoothing > 0"),
    ],
)
def test_a_bad_dpo_loss_setting_fails_with_one_line(tmp_path, override, needle):
    from conftest import write_recipe
    from test_cli_errors import assert_clean_error

    recipe = write_recipe(tmp_path / "recipe.yaml", recipe_for("dpo", tmp_path))
    out = tmp_path / "out"
    proc = run_accord_here("train", recipe, *override.split(), f"output.dir={out}")
    assert_clean_error(proc, needle)
    assert not out.exists()
