"""task: distill — against TRL's GKDTrainer (off-policy, whole runs) and DistillationTrainer's
divergence (on the same sampled completions), the per-step choice of completions and their
samples independent of the layout, and the same updates on 1 and 2 processes."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import TINY_RECIPE, assert_ok, run_accord, write_jsonl, write_recipe
from test_hub import offline_hub  # noqa: F401 (a fixture)

STUDENT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
# A wider teacher with the student's (byte) vocabulary; large initial weights make its
# distributions peaked, far from the student's near-uniform ones.
TEACHER = {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}


def _lm(tokenizer, settings: dict, seed: int, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        **settings,
        num_key_value_heads=2,
        max_position_embeddings=64,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )
    return LlamaForCausalLM(config)


def _folders(root):
    """(student folder, teacher folder), saved as save_pretrained folders."""
    from accord.models.build import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    student, teacher = root / "student", root / "teacher"
    if not teacher.is_dir():
        _lm(tokenizer, STUDENT, 0).save_pretrained(student)
        _lm(tokenizer, TEACHER, 1, initializer_range=0.3).save_pretrained(teacher)
    return student, teacher


def _rows(count: int, seed: int = 3) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"prompt": f"{a}+{b}=", "completion": str(a + b)})
    return rows


def _recipe(root, **distill) -> dict:
    student, teacher = _folders(root)
    return {
        "seed": 7,
        "model": {"path": str(student), "tokenizer": "byte"},
        "task": "distill",
        "distill": {"teacher": str(teacher), "max_new_tokens": 6} | distill,
        "data": {
            "train": str(write_jsonl(root / "rows.jsonl", _rows(48))),
            "max_length": 32,
            "shuffle": False,
            "cache_dir": str(root / "cache"),
        },
        "batch": {"global_batch_size": 8, "micro_batch_size": 4},
        "optim": {"lr": 3.0e-3, "schedule": "constant", "warmup_steps": 0, "max_grad_norm": 1.0},
        "train": {"max_steps": 3, "log_every": 1},
        "engine": TINY_RECIPE["engine"] | {"processes": 1},
        "output": {"dir": str(root / "out")},
    }


def _task(root, chunk: int | str = "auto", **distill):
    from accord.models.build import build_byte_tokenizer
    from accord.recipe.schema import validate_recipe
    from accord.tasks import build_task, task_config

    tokenizer = build_byte_tokenizer()
    recipe = _recipe(root, **distill)
    recipe["train"]["loss_chunk_size"] = chunk
    return build_task(task_config(validate_recipe(recipe)), tokenizer), tokenizer


def _examples(task, rows: list[dict]) -> list[dict]:
    import datasets

    train, _ = task.fit(datasets.Dataset.from_list(rows), None)
    encoded = task.encode_batch(train.to_dict())
    return [{"input_ids": encoded["input_ids"][i], "labels": encoded["labels"][i]} for i in range(len(rows))]


def _ready(task, root):
    """The task's student (the folder's weights) and teacher, as setup() leaves them on one CPU process."""
    from transformers import AutoModelForCausalLM

    from accord.models.weights import materialize

    student_folder, _ = _folders(root)
    model = AutoModelForCausalLM.from_pretrained(student_folder)
    task.configure_model(model)
    task.teacher.module = materialize(task.teacher.module, "cpu").eval()
    task.teacher.policy = task.policy = model
    return model


# ---------------------------------------------------------------- one process, no workers


def test_a_steps_completions_come_from_one_seeded_coin_per_step():
    """lmbda is the share of on-policy steps; the draw depends on (seed, step) only, so every
    rank of every layout makes the same choice; seq_kd turns the other steps into the teacher's."""
    from accord.tasks.distill import completion_source

    draws = [completion_source(7, step, 0.3, False) for step in range(400)]
    assert draws == [completion_source(7, step, 0.3, False) for step in range(400)]
    assert 0.22 < draws.count("student") / len(draws) < 0.38 and set(draws) == {"student", "data"}
    assert draws != [completion_source(8, step, 0.3, False) for step in range(400)]
    assert {completion_source(7, step, 0.3, True) for step in range(50)} == {"student", "teacher"}
    assert {completion_source(7, step, 0.0, False) for step in range(50)} == {"data"}
    assert {completion_source(7, step, 1.0, True) for step in range(50)} == {"student"}


def test_the_prompt_of_a_row_is_everything_before_its_last_answer():
    from accord.tasks.distill import IGNORE, prompt_ids

    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    labels = [IGNORE, IGNORE, 3, 4, IGNORE, IGNORE, 7, 8]  # two assistant turns
    assert prompt_ids(ids, labels) == [1, 2, 3, 4, 5, 6]
    assert prompt_ids(ids, [IGNORE] * 3 + ids[3:]) == [1, 2, 3]


@pytest.mark.parametrize("source", ["student", "teacher"])
def test_sampled_completions_do_not_depend_on_which_rows_share_the_call(source, tmp_path):
    """Each row's completion is drawn with its own seed (seed, step, row): the rows sampled
    together or in two halves (two ranks) get the same tokens; its prompt is the row's, its
    targets the sampled tokens only."""
    from accord.tasks.distill import IGNORE

    task, _ = _task(tmp_path, lmbda=1.0 if source == "student" else 0.0, seq_kd=source == "teacher")
    examples = _examples(task, _rows(6))
    _ready(task, tmp_path)
    ids = list(range(10, 16))
    task.rollout(4, ids, examples)
    together = dict(task._sequences)
    task.rollout(4, ids[:2], examples[:2])
    first = dict(task._sequences)
    task.rollout(4, ids[2:], examples[2:])
    assert together == first | task._sequences
    task.rollout(5, ids, examples)
    assert together != task._sequences  # another step draws other samples
    for example, seq in zip(examples, together.values()):
        prompt = len(example["labels"]) - sum(label != IGNORE for label in example["labels"])
        assert seq["input_ids"][:prompt] == example["input_ids"][:prompt]
        assert seq["labels"][:prompt] == [IGNORE] * prompt and seq["labels"][prompt:] == seq["input_ids"][prompt:]
        assert 0 < len(seq["input_ids"]) - prompt <= 6


def test_chat_rows_train_on_the_assistant_turns_and_sample_after_the_last_prompt(tmp_path):
    """Conversational rows as sft reads them: off-policy targets are the assistant turns; a
    sampled completion follows the conversation up to its last assistant turn (rendered with
    the generation prompt, as TRL's chat collator builds GKD's prompt) and replaces that turn."""
    import datasets

    from accord.tasks.distill import IGNORE, prompt_ids

    task, tokenizer = _task(tmp_path, lmbda=1.0)
    turns = [
        {"role": "user", "content": "1+2"},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "2+2"},
        {"role": "assistant", "content": "4"},
    ]
    train, _ = task.fit(datasets.Dataset.from_list([{"messages": turns}, {"messages": turns[:2]}]), None)
    encoded = task.encode_batch(train.to_dict())
    examples = [{"input_ids": encoded["input_ids"][i], "labels": encoded["labels"][i]} for i in range(2)]
    for example, conversation in zip(examples, (turns, turns[:2])):
        targets = tokenizer.decode([t for t in example["labels"] if t != IGNORE])
        assert targets.startswith("3") and ("4" in targets) == (len(conversation) == 4)
        prompt = tokenizer.decode(prompt_ids(example["input_ids"], example["labels"]))
        assert prompt == tokenizer.apply_chat_template(conversation[:-1], tokenize=False, add_generation_prompt=True)
    _ready(task, tmp_path)
    task.rollout(0, [0, 1], examples)
    for rid, example in enumerate(examples):
        sampled = task._sequences[rid]
        prompt = prompt_ids(example["input_ids"], example["labels"])
        assert sampled["input_ids"][: len(prompt)] == prompt and set(sampled["labels"][: len(prompt)]) == {IGNORE}


def test_a_data_step_of_an_online_run_trains_on_the_rows_as_collated(tmp_path):
    from accord.tasks.distill import completion_source

    task, _ = _task(tmp_path, lmbda=0.5)
    step = next(s for s in range(20) if completion_source(7, s, 0.5, False) == "data")
    examples = _examples(task, _rows(4))
    summary = task.rollout(step, [0, 1, 2, 3], examples)
    batch = task.rollout_batch([0, 1, 2, 3])
    expected = task.collate([[e] for e in examples])
    assert all(torch.equal(batch[k], expected[k]) for k in expected)
    assert summary.targets == int((expected["labels"][:, 1:] != -100).sum())


@pytest.mark.parametrize(("beta", "temperature", "chunk"), [(0.5, 0.7, "auto"), (0.0, 1.0, 3), (1.0, 2.0, 4)])
def test_on_policy_divergence_and_gradient_equal_trl_distillation_trainers_on_the_same_completions(
    beta, temperature, chunk, tmp_path
):
    """TRL's DistillationTrainer samples with its own generator, so its objective is compared on
    the completions accord sampled: its chunked divergence (the teacher's and the student's
    hidden states at the completion positions through their own output layers, temperature on
    both) equals accord's loss per completion token, and so does the gradient, with accord's
    divergence over whole logits (auto, at this size) or `chunk` positions at a time."""
    pytest.importorskip("trl")
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    task, _ = _task(tmp_path, chunk=chunk, lmbda=1.0, beta=beta, temperature=temperature)
    model = _ready(task, tmp_path)
    ids = list(range(5))
    task.rollout(0, ids, _examples(task, _rows(5)))
    batch = task.rollout_batch(ids)
    out = task.loss(model, batch)
    ours = out.loss_sum / out.num_targets
    (our_grad,) = torch.autograd.grad(ours, model.model.embed_tokens.weight)

    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    targets = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)], 1) != -100
    student_h = model.model(**inputs).last_hidden_state[targets][None]
    with torch.no_grad():
        teacher_h = task.teacher.module.model(**inputs).last_hidden_state[targets][None]
    theirs, _, count = _chunked_divergence_loss(
        student_h,
        teacher_h,
        model.lm_head.weight,
        task.teacher.module.lm_head.weight,
        torch.ones(student_h.shape[:2]),
        beta,
        temperature=temperature,
    )
    (their_grad,) = torch.autograd.grad(theirs, model.model.embed_tokens.weight)
    assert int(count) == int(out.num_targets) > 5 and theirs.item() > 1e-3
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-4, atol=1e-8)


def test_the_chunked_divergence_equals_the_whole_logits_one(tmp_path):
    """train.loss_chunk_size: the teacher's logits at the target positions only, the student's
    a few positions at a time (recomputed in backward): the same loss, entropy and gradient as
    whole logits, a row without targets included."""
    from accord.tasks.chunked_loss import HeadCall

    grads, outs = [], []
    for chunk in (0, 3):
        task, _ = _task(tmp_path, chunk=chunk, lmbda=0.0, beta=0.3, temperature=1.5)
        model = _ready(task, tmp_path)
        assert (task.heads is None) == (chunk == 0)
        examples = _examples(task, _rows(5))
        examples[2]["labels"] = [-100] * len(examples[2]["labels"])
        out = task.loss(model, task.collate([[e] for e in examples]))
        (grad,) = torch.autograd.grad(out.loss_sum, model.model.embed_tokens.weight)
        grads.append(grad)
        outs.append(out)
    assert isinstance(task.heads[0], HeadCall) and outs[0].num_targets == outs[1].num_targets
    torch.testing.assert_close(outs[1].loss_sum, outs[0].loss_sum, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(outs[1].metrics["entropy"], outs[0].metrics["entropy"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-8)


def test_each_output_layer_has_one_replaced_forward_however_many_chunked_users_it_has(tmp_path):
    """The teacher's ReferenceModel installs the chunked loss on both models' output layers and
    distill its divergence: one HeadCall a layer, wrapping the layer's own forward."""
    from torch import nn

    task, _ = _task(tmp_path, chunk=3, lmbda=0.0)
    model = _ready(task, tmp_path)
    layers = (model.get_output_embeddings(), task.teacher.module.get_output_embeddings())
    users = (task.teacher.logprobs, task.teacher.reference_logprobs)
    for call, user, layer in zip(task.heads, users, layers):
        assert user.call is call and call.head is layer and layer.forward.__self__ is call
        assert call._plain.__func__ is nn.Linear.forward and call._plain.__self__ is layer


def test_a_hub_teacher_is_pinned_to_a_commit_and_read_from_the_cache(offline_hub, tmp_path):  # noqa: F811
    """distill.teacher as a hub name: pinned like model.path (its commit recorded as
    distill.teacher_revision), and its vocabulary read from the cached snapshot."""
    from accord.models.build import build_byte_tokenizer
    from accord.recipe.hub import pin
    from accord.recipe.schema import validate_recipe
    from accord.tasks import build_task, task_config
    from test_hub import MODEL, MODEL_COMMIT, fake_model

    fake_model(offline_hub)
    recipe = _recipe(tmp_path)
    recipe["distill"]["teacher"] = MODEL
    pinned = pin(validate_recipe(recipe))
    assert pinned.distill.teacher == MODEL and pinned.distill.teacher_revision == MODEL_COMMIT
    assert build_task(task_config(pinned), build_byte_tokenizer()).teacher_vocab == 262


def test_a_teacher_whose_tokenizer_maps_tokens_to_other_ids_is_refused(tmp_path):
    """The same vocabulary size is not enough: a teacher folder's own tokenizer must give every
    token the student's id (one saved from the student's tokenizer passes)."""
    import shutil

    from transformers import PreTrainedTokenizerFast

    from accord.errors import UserInputError
    from accord.models.build import build_byte_tokenizer

    _, teacher = _folders(tmp_path)
    same, other = tmp_path / "same", tmp_path / "other"
    shutil.copytree(teacher, same)
    build_byte_tokenizer().save_pretrained(same)
    task, _ = _task(tmp_path, teacher=str(same))
    assert task.teacher_vocab == 262
    shutil.copytree(teacher, other)
    vocab = build_byte_tokenizer().get_vocab()
    a, b = sorted(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids
    from tokenizers import Tokenizer, models

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token=a))).save_pretrained(other)
    with pytest.raises(UserInputError, match=r"differs from the student's on 2 token\(s\)"):
        _task(tmp_path, teacher=str(other))


def test_a_teacher_with_another_vocabulary_is_refused_naming_both_sizes(tmp_path):
    from accord.errors import UserInputError

    _folders(tmp_path)
    other = tmp_path / "other-teacher"
    from transformers import LlamaConfig

    LlamaConfig(**TEACHER, num_key_value_heads=2, vocab_size=300).save_pretrained(other)
    with pytest.raises(UserInputError, match=r"the teacher's vocabulary has 300 tokens and the student's 262"):
        _task(tmp_path, teacher=str(other))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"teacher": None}, "task distill needs a teacher: set distill.teacher"),
        ({"beta": 1.5}, "distill.beta"),
        ({"temperature": 0}, "distill.temperature"),
        ({"lmbda": -0.1}, "distill.lmbda"),
        ({"teacher": "no/such-folder-here"}, "distill.teacher"),
        ({"teacher": "other-vocabulary"}, "the teacher's vocabulary has 300 tokens and the student's 262"),
    ],
)
def test_a_bad_distill_recipe_is_one_line_and_exit_2(change, message, tmp_path):
    from conftest import run_accord_here

    recipe = _recipe(tmp_path)
    recipe["distill"] = {k: v for k, v in (recipe["distill"] | change).items() if v is not None}
    if change.get("teacher") == "no/such-folder-here":
        recipe["distill"]["teacher"] = str(tmp_path / "no-such-teacher")
    if change.get("teacher") == "other-vocabulary":
        from transformers import LlamaConfig

        LlamaConfig(**TEACHER, num_key_value_heads=2, vocab_size=300).save_pretrained(tmp_path / "other")
        recipe["distill"]["teacher"] = str(tmp_path / "other")
    proc = run_accord_here("train", write_recipe(tmp_path / "bad.yaml", recipe))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("accord: error")]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def distill_runs(tmp_path_factory):
    """Off-policy on 1 process (1 × 4 × 2, for TRL's GKDTrainer); mixed (lmbda 0.5 and seq_kd:
    the student's and the teacher's samples; the chunked divergence) on 1 process and on 2
    (2 × 2 × 2) with evaluation and a checkpoint at step 2."""
    root = tmp_path_factory.mktemp("distill")
    recipe = _recipe(root, lmbda=0.0, beta=0.5)
    path = write_recipe(root / "off.yaml", recipe)
    outs = {"off": root / "off"}
    assert_ok(run_accord("train", path, f"output.dir={outs['off']}"))
    mixed = _recipe(root, lmbda=0.5, seq_kd=True, beta=0.3, temperature=0.8)
    mixed["data"] |= {"eval_fraction": 0.1, "shuffle": True}
    mixed["train"] = {"max_steps": 4, "log_every": 1, "eval_every": 4}
    mixed["checkpoint"] = {"every_steps": 2}
    mixed["train"]["loss_chunk_size"] = 4  # the chunked divergence (the off-policy run: whole logits)
    path = write_recipe(root / "mixed.yaml", mixed)
    for processes, micro in ((1, 4), (2, 2)):
        outs[processes] = root / f"mixed-p{processes}"
        proc = run_accord(
            "train",
            path,
            f"engine.processes={processes}",
            f"batch.micro_batch_size={micro}",
            f"output.dir={outs[processes]}",
        )
        assert_ok(proc)
    return outs


def _gkd_losses(root, steps: int) -> list[float]:
    """TRL's GKDTrainer, off-policy (lmbda 0), on the tokens accord made of the same rows, in
    the same order (sequential, 4 a micro-batch, 2 accumulated), from the same folders."""
    import datasets
    from transformers import AutoModelForCausalLM
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from accord.tasks.base import pad_rows

    task, tokenizer = _task(root, lmbda=0.0, beta=0.5)
    examples = _examples(task, _rows(48))

    def collate(batch):
        ids = pad_rows([e["input_ids"] for e in batch], tokenizer.pad_token_id)
        lengths = torch.tensor([len(e["input_ids"]) for e in batch])
        mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": pad_rows([e["labels"] for e in batch], -100)}

    student, teacher = _folders(root)
    config = GKDConfig(
        output_dir=str(root / "trl"),
        lmbda=0.0,
        beta=0.5,
        max_length=64,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        weight_decay=0.0,
        optim="adamw_torch",
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        train_sampling_strategy="sequential",
        gradient_checkpointing=False,
    )
    trainer = GKDTrainer(
        model=AutoModelForCausalLM.from_pretrained(student),
        teacher_model=AutoModelForCausalLM.from_pretrained(teacher),
        args=config,
        processing_class=tokenizer,
        data_collator=collate,
        train_dataset=datasets.Dataset.from_list(examples),
    )
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.distributed
def test_off_policy_steps_equal_trl_gkd_trainers_on_the_same_tokens_order_and_weights(distill_runs):
    """GKDTrainer with lmbda 0 trains on the data's completions, deterministically: its logged
    loss of every step equals accord's (fp32, one process, the same AdamW and clipping)."""
    pytest.importorskip("trl")
    from conftest import step_losses

    ours = step_losses(distill_runs["off"])
    theirs = _gkd_losses(distill_runs["off"].parent, steps=3)
    assert sorted(ours) == [1, 2, 3] and len(theirs) == 3
    for step, loss in zip(sorted(ours), theirs):
        assert abs(ours[step] - loss) < 1e-5, (step, ours[step], loss)
    assert ours[3] < ours[1]


@pytest.mark.distributed
def test_mixed_distillation_on_two_processes_with_accumulation_makes_the_one_process_updates(distill_runs):
    """The step's source and each row's sample are functions of (seed, step, row), and the loss
    is normalised over the whole global batch's completion tokens: 1 × 4 × 2 and 2 × 2 × 2 log
    the same losses and end with the same weights, over on-policy and teacher-sampled steps."""
    from accord.observe.metrics import read_metrics
    from conftest import final_params, max_param_diff, step_losses

    one, two = (step_losses(distill_runs[p]) for p in (1, 2))
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    for step in one:
        assert abs(one[step] - two[step]) < 1e-5, (step, one[step], two[step])
    assert max_param_diff(final_params(distill_runs[1]), final_params(distill_runs[2])) < 1e-5
    records = {p: [r for r in read_metrics(distill_runs[p]) if r["kind"] == "train"] for p in (1, 2)}
    assert {r["on_policy"] for r in records[1]} == {0.0, 1.0}  # both kinds of step were taken
    assert [r["teacher_sampled"] for r in records[1]] == [1 - r["on_policy"] for r in records[1]]
    for a, b in zip(records[1], records[2]):
        assert a["targets"] == b["targets"] and a["completions/mean_length"] == b["completions/mean_length"]
        assert abs(a["entropy"] - b["entropy"]) < 1e-4
    evals = [r for r in read_metrics(distill_runs[2]) if r["kind"] == "eval"]
    assert evals and evals[-1]["loss"] > 0 and "entropy" in evals[-1]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_mixed_run_resumed_on_one_process_ends_as_the_uninterrupted_two_process_run(distill_runs, tmp_path):
    from conftest import final_params, max_param_diff, step_losses

    out = tmp_path / "resumed"
    checkpoint = distill_runs[2] / "checkpoints" / "step-000002"
    recipe = distill_runs[2].parent / "mixed.yaml"
    args = ("engine.processes=1", "batch.micro_batch_size=4", f"resume={checkpoint}", f"output.dir={out}")
    assert_ok(run_accord("train", recipe, *args))
    whole, resumed = step_losses(distill_runs[2]), step_losses(out)
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert abs(whole[step] - resumed[step]) < 1e-5, (step, whole[step], resumed[step])
    assert max_param_diff(final_params(distill_runs[2]), final_params(out)) < 1e-5


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_mixed_distillation_under_a_sharded_strategy_makes_the_ddp_updates(distill_runs, strategy, tmp_path):
    """The teacher is sharded like the student; both generate in lockstep (one call per row on
    every rank) and the updates are the ddp run's."""
    from conftest import final_params, max_param_diff, step_losses

    if strategy == "zero3":
        pytest.importorskip("deepspeed")
    out = tmp_path / strategy
    recipe = distill_runs[2].parent / "mixed.yaml"
    args = ("engine.processes=2", "batch.micro_batch_size=2", f"engine.strategy={strategy}", f"output.dir={out}")
    assert_ok(run_accord("train", recipe, *args))
    ddp, sharded = step_losses(distill_runs[2]), step_losses(out)
    for step in ddp:
        assert abs(ddp[step] - sharded[step]) < 1e-5, (step, ddp[step], sharded[step])
    assert max_param_diff(final_params(distill_runs[2]), final_params(out)) < 1e-4


@pytest.mark.slow
@pytest.mark.distributed
def test_lora_on_the_student_distills_with_the_whole_teacher(distill_runs, tmp_path):
    """LoRA adapts the student only; the teacher is a separate frozen model (not the adapters-off student)."""
    from accord.observe.metrics import read_metrics

    out = tmp_path / "lora"
    recipe = distill_runs[2].parent / "mixed.yaml"
    args = ("lora.r=4", "lora.alpha=8", "lora.target_modules=all-linear", f"output.dir={out}")
    assert_ok(run_accord("train", recipe, "engine.processes=2", "batch.micro_batch_size=2", *args))
    losses = [r["loss"] for r in read_metrics(out) if r["kind"] == "train"]
    assert len(losses) == 4 and all(loss > 0 for loss in losses)
