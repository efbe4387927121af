"""task: reward — a pairwise (Bradley-Terry) reward model whose final/ folder is a plain
transformers sequence classifier with one output, trained invariantly to the layout."""

from __future__ import annotations

import json

import pytest
import torch

from accord.observe.metrics import read_metrics
from conftest import assert_ok, final_params, max_param_diff, recipe_for, run_accord, write_jsonl, write_recipe

TOLERANCE = 1e-5


def _tiny_classifier(tokenizer):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from conftest import TINY_RECIPE

    settings = {k: v for k, v in TINY_RECIPE["model"]["config"].items() if k != "architecture"}
    torch.manual_seed(0)
    config = LlamaConfig(**settings, vocab_size=len(tokenizer), num_labels=1, pad_token_id=tokenizer.pad_token_id)
    return LlamaForSequenceClassification(config)


def _reward_task(tmp_path, recipe=None):
    """The reward task of `recipe` (by default the tiny reward recipe), with its byte tokenizer."""
    from accord.models.build import build_byte_tokenizer
    from accord.recipe.schema import validate_recipe
    from accord.tasks import build_task, task_config

    tokenizer = build_byte_tokenizer()
    recipe = recipe or validate_recipe(recipe_for("reward", tmp_path))
    return build_task(task_config(recipe), tokenizer), tokenizer


def _wordpiece_tokenizer(folder):
    """A tiny BERT-style tokenizer ([CLS] text [SEP]) built from a vocabulary file."""
    from transformers import BertTokenizerFast

    vocab = folder / "vocab.txt"
    vocab.write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "is", "red", "a", "colour", "dog", "?"]) + "\n"
    )
    return BertTokenizerFast(vocab_file=str(vocab))


@pytest.mark.parametrize("kind", ["byte", "wordpiece"])
def test_a_pair_trains_on_the_tokens_that_tokenizer_gives_for_prompt_plus_answer(tmp_path, kind):
    """What plain transformers scores, tokenizer(prompt + answer), is what training saw: the
    BOS before (byte), an encoder's [CLS] before and [SEP] after (wordpiece)."""
    from accord.models.build import build_byte_tokenizer
    from accord.recipe.schema import validate_recipe
    from accord.tasks import build_task, task_config

    tokenizer = build_byte_tokenizer() if kind == "byte" else _wordpiece_tokenizer(tmp_path)
    task = build_task(task_config(validate_recipe(recipe_for("reward", tmp_path))), tokenizer)
    prompt, chosen, rejected = "is red ", "a colour", "a dog ?"
    encoded = task.encode_batch({"prompt": [prompt], "chosen": [chosen], "rejected": [rejected]})
    assert encoded["chosen_input_ids"] == [tokenizer(prompt + chosen)["input_ids"]]
    assert encoded["rejected_input_ids"] == [tokenizer(prompt + rejected)["input_ids"]]


def test_the_pair_loss_equals_a_bare_torch_loss_over_each_text_scored_alone(tmp_path):
    """The padded pair batch gives the loss that transformers' own scores of each whole text,
    unpadded, give: -log σ(r(prompt + chosen) − r(prompt + rejected)), summed; and the same
    gradients."""
    task, tokenizer = _reward_task(tmp_path)
    rows = [("2+2=", "4", "5"), ("what is red? ", "a colour", "a small dog that sat"), ("hi", " there, friend", "!")]
    encoded = task.encode_batch(
        {"prompt": [r[0] for r in rows], "chosen": [r[1] for r in rows], "rejected": [r[2] for r in rows]}
    )
    model = _tiny_classifier(tokenizer)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # rewards far from zero: a loss worth comparing
    ours = task.loss(
        model, task.collate([[{name: column[i] for name, column in encoded.items()}] for i in range(len(rows))])
    )
    ours_grads = torch.autograd.grad(ours.loss_sum, model.score.weight)[0]

    def reward(text):
        return model(**tokenizer(text, return_tensors="pt")).logits[0, 0]

    bare = sum(-torch.nn.functional.logsigmoid(reward(p + c) - reward(p + r)) for p, c, r in rows)
    bare_grads = torch.autograd.grad(bare, model.score.weight)[0]
    assert ours.num_targets.item() == len(rows) and bare.item() > 0.05
    torch.testing.assert_close(ours.loss_sum, bare, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_grads, bare_grads, rtol=1e-5, atol=1e-6)


# Importing TRL and building its trainer costs seconds; the bare-torch check above is the default tier's.
@pytest.mark.slow
def test_the_pair_loss_equals_trl_reward_trainers_on_the_same_batch(tmp_path):
    """TRL's own collator lays out the same batch, and RewardTrainer.compute_loss (the mean
    over pairs) equals accord's summed pair loss divided by the pair count."""
    pytest.importorskip("trl")
    from trl import RewardConfig, RewardTrainer
    from trl.trainer.reward_trainer import DataCollatorForPreference

    task, tokenizer = _reward_task(tmp_path)
    rows = [("2+2=", "4", "5"), ("what is red? ", "a colour", "a small dog that sat"), ("hi", " there, friend", "!")]
    encoded = task.encode_batch(
        {"prompt": [r[0] for r in rows], "chosen": [r[1] for r in rows], "rejected": [r[2] for r in rows]}
    )
    examples = [{name: column[i] for name, column in encoded.items()} for i in range(len(rows))]
    batch = task.collate([[e] for e in examples])
    trl_batch = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)(
        [{"chosen_ids": e["chosen_input_ids"], "rejected_ids": e["rejected_input_ids"]} for e in examples]
    )
    assert torch.equal(batch["input_ids"], trl_batch["input_ids"]) and torch.equal(
        batch["attention_mask"], trl_batch["attention_mask"]
    )

    model = _tiny_classifier(tokenizer)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # rewards far from zero: a loss worth comparing
    import datasets

    pairs = datasets.Dataset.from_list(
        [{"chosen_ids": e["chosen_input_ids"], "rejected_ids": e["rejected_input_ids"]} for e in examples]
    )
    args = RewardConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True)
    trainer = RewardTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=pairs)
    trl_loss = trainer.compute_loss(model, dict(trl_batch))
    ours = task.loss(model, batch)
    assert ours.num_targets.item() == len(rows)
    torch.testing.assert_close(ours.loss_sum / ours.num_targets, trl_loss, rtol=1e-6, atol=1e-6)
    assert trl_loss.item() > 0.05


def test_data_without_a_rejected_answer_is_one_line_naming_the_file(tmp_path):
    from accord.data.prepare import prepare_data
    from accord.data.sources import DataError
    from accord.recipe.schema import validate_recipe

    recipe = validate_recipe(recipe_for("reward", tmp_path))
    bad = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "2+2=", "chosen": "4", "worse": "5"}] * 8)
    recipe.data.train[0].path = str(bad)
    task, tokenizer = _reward_task(tmp_path, recipe)
    with pytest.raises(DataError) as caught:
        prepare_data(recipe.data, recipe.seed, tokenizer, task, preparer=True)
    message = str(caught.value)
    assert "\n" not in message
    assert message == (
        f"{bad}: reward data (prompt/chosen/rejected as text or chat messages): missing field 'rejected' "
        f"(fields present: prompt, chosen, worse); rename with fields: {{rejected: <column>}}"
    )


def test_chat_pairs_encode_as_the_template_renders_each_whole_conversation(tmp_path):
    """Conversational rows (a shared `prompt` conversation, or none) train on exactly the
    tokens that scoring the rendered conversation with plain transformers gives."""
    from accord.data.prepare import prepare_data
    from accord.recipe.schema import validate_recipe

    recipe = validate_recipe(recipe_for("reward", tmp_path))
    task, tokenizer = _reward_task(tmp_path, recipe)
    user = [{"role": "user", "content": "2+2?"}]
    rows = [
        {
            "prompt": user,
            "chosen": [{"role": "assistant", "content": "4"}],
            "rejected": [{"role": "assistant", "content": "5"}],
        },
        {
            "chosen": user + [{"role": "assistant", "content": "four"}],
            "rejected": user + [{"role": "assistant", "content": "fish"}],
        },
    ]
    recipe.data.train[0].path = str(write_jsonl(tmp_path / "chat.jsonl", rows * 8))
    prepared = prepare_data(recipe.data, recipe.seed, tokenizer, task, preparer=True)

    def render(messages):
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    examples = list(prepared.train) + list(prepared.eval)
    by_answer = {tuple(e["chosen_input_ids"]): e for e in examples}
    for row in rows:
        prompt = row.get("prompt", [])
        chosen, rejected = render(prompt + row["chosen"]), render(prompt + row["rejected"])
        assert tuple(chosen) in by_answer and by_answer[tuple(chosen)]["rejected_input_ids"] == rejected
    assert task.chat


# ---------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-process DDP run (2 × 8 × 2) of the tiny reward recipe, evaluated before and after."""
    root = tmp_path_factory.mktemp("reward")
    recipe = write_recipe(
        root / "recipe.yaml",
        recipe_for("reward", root, train={"max_steps": 10, "log_every": 1, "eval_on_start": True, "eval_every": 10}),
    )
    out = root / "ddp"
    proc = run_accord("train", recipe, f"output.dir={out}")
    assert_ok(proc)
    return recipe, out, proc


def _scores(folder, texts):
    """Rewards from final/ with plain transformers (no accord code), one padded batch."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        return model(**tokenizer(texts, return_tensors="pt", padding=True)).logits.squeeze(-1)


def _ranked_fraction(folder, rows) -> float:
    scores = _scores(folder, [r["prompt"] + r["chosen"] for r in rows] + [r["prompt"] + r["rejected"] for r in rows])
    return (scores[: len(rows)] > scores[len(rows) :]).float().mean().item()


@pytest.mark.distributed
def test_final_folder_is_a_plain_one_output_classifier_that_ranks_the_trained_pairs(trained):
    from transformers import AutoConfig

    recipe, out, proc = trained
    config = AutoConfig.from_pretrained(out / "final")
    assert config.num_labels == 1 and config.architectures == ["LlamaForSequenceClassification"]
    assert config.pad_token_id is not None  # transformers finds the last token through it
    rows = [json.loads(line) for line in (recipe.parent / "pairs.jsonl").read_text().splitlines()]
    assert _ranked_fraction(out / "final", rows) >= 0.95
    # Padding does not move a score: a batch of unequal lengths scores as each text alone.
    texts = [rows[0]["prompt"] + rows[0]["chosen"], rows[1]["prompt"] + rows[1]["rejected"] + " and more words here"]
    alone = torch.cat([_scores(out / "final", [t]) for t in texts])
    torch.testing.assert_close(_scores(out / "final", texts), alone, rtol=1e-5, atol=1e-5)

    evals = [r for r in read_metrics(out) if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [0, 10] and {"loss", "accuracy", "margin"} <= set(evals[-1])
    assert evals[-1]["accuracy"] > evals[0]["accuracy"] and evals[-1]["margin"] > evals[0]["margin"]
    train = [r for r in read_metrics(out) if r["kind"] == "train"]
    assert len(train) == 10 and {"accuracy", "margin"} <= set(train[-1])
    assert "accuracy" in proc.stderr + proc.stdout and "margin" in proc.stderr + proc.stdout


@pytest.mark.slow  # one more run; the 2-process run above is the default tier's
@pytest.mark.distributed
def test_one_process_with_other_micro_batches_ends_with_the_same_parameters(trained, tmp_path):
    recipe, out, _ = trained
    single = tmp_path / "1x4x8"
    assert_ok(run_accord("train", recipe, "engine.processes=1", "batch.micro_batch_size=4", f"output.dir={single}"))
    diff = max_param_diff(final_params(out), final_params(single))
    print(f"reward: max |Δparam| 2x8x2 vs 1x4x8 = {diff:.2e}")
    assert diff <= TOLERANCE


@pytest.mark.slow  # two more 2-process runs
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_sharded_strategies_end_where_ddp_does(trained, tmp_path, strategy):
    import importlib.util

    if strategy == "zero3" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed")
    recipe, out, _ = trained
    sharded = tmp_path / strategy
    assert_ok(run_accord("train", recipe, f"engine.strategy={strategy}", f"output.dir={sharded}"))
    diff = max_param_diff(final_params(out), final_params(sharded))
    print(f"reward: max |Δparam| {strategy} vs ddp = {diff:.2e}")
    assert diff <= TOLERANCE


@pytest.mark.slow  # two more 2-process runs
@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's load
def test_lora_trains_the_adapters_and_head_and_exports_a_merged_classifier(trained, tmp_path):
    """With LoRA only the adapters and the score head train; final/ is merged (no peft needed),
    still ranks the pairs, and fsdp ends where ddp does."""
    recipe, _, _ = trained
    lora = ("lora.r=4", "lora.alpha=8", "lora.target_modules=[q_proj,v_proj]", "optim.lr=1.0e-2")
    outs = {}
    for strategy in ("ddp", "fsdp"):
        outs[strategy] = tmp_path / strategy
        proc = run_accord("train", recipe, *lora, f"engine.strategy={strategy}", f"output.dir={outs[strategy]}")
        assert_ok(proc)
        assert "k trained)" in proc.stderr
    params = final_params(outs["ddp"])
    assert not any("lora" in name for name in params)
    assert json.loads((outs["ddp"] / "adapter" / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    rows = [json.loads(line) for line in (recipe.parent / "pairs.jsonl").read_text().splitlines()]
    assert _ranked_fraction(outs["ddp"] / "final", rows) >= 0.9
    assert max_param_diff(params, final_params(outs["fsdp"])) <= TOLERANCE
    # adapter/ (with the trained head as a module to save) loads with peft alone to the same scores
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoTokenizer

    texts = [rows[0]["prompt"] + rows[0]["chosen"], rows[1]["prompt"] + rows[1]["rejected"]]
    tokenizer = AutoTokenizer.from_pretrained(outs["ddp"] / "adapter")
    with torch.no_grad():
        model = AutoPeftModelForSequenceClassification.from_pretrained(outs["ddp"] / "adapter").eval()
        adapted = model(**tokenizer(texts, return_tensors="pt", padding=True)).logits.squeeze(-1)
    assert torch.allclose(adapted, _scores(outs["ddp"] / "final", texts), atol=1e-5)
