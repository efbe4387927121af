"""task: grpo — per-sample seeded sampling, the loss against TRL's own code, reward functions
and their one-line errors, and (slow tier) the update's independence of world size and micro
batch, resume on another world size, and generation under fsdp and zero3."""

from __future__ import annotations

import copy
import json
import math
import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from accord.errors import UserInputError
from accord.recipe.grpo import GRPOConfig
from accord.recipe.schema import RecipeError, validate_recipe
from accord.tasks import task_config
from accord.tasks.grpo import GRPOTask, Rollout
from accord.tasks.grpo_loss import grpo_token_loss
from accord.tasks.rewards import Group, RewardFailed, RewardFunctions
from accord.tasks.rollout import (
    PerSampleGumbel,
    completion_logprobs,
    sample_group,
    sample_groups,
    sample_seed,
    token_logprobs,
)
from conftest import TINY_RECIPE, assert_ok, final_params, max_param_diff, run_accord, write_recipe


def _tiny_llama(vocab: int = 40):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


# ---------------------------------------------------------------- sampling


def test_completion_depends_only_on_its_own_seed_not_on_its_batch():
    model = _tiny_llama()
    prompt = [1, 5, 9, 7]
    seeds = [sample_seed(3, 0, 11, k) for k in range(3)]
    kwargs = dict(max_new_tokens=5, temperature=1.0, top_p=1.0, eos_id=2, pad_id=0, lockstep=False)
    together = sample_group(model, prompt, seeds, **kwargs)
    reordered = sample_group(model, prompt, [seeds[2], seeds[1]], **kwargs)
    alone = [sample_group(model, prompt, [s], **kwargs)[0] for s in seeds]
    assert together == alone
    assert reordered == [together[2], together[1]]
    assert len({tuple(c) for c in together}) > 1, "different seeds should give different completions"
    # Beside a prompt of another length in one generate call (how a rank samples its prompts
    # of one padded width under ddp, left-padded), each group is the one it is alone.
    other, other_seeds = [1, 8, 3], [sample_seed(3, 0, 12, k) for k in range(2)]
    both = sample_groups(model, [other, prompt], [other_seeds, seeds], **kwargs)
    assert both == [sample_group(model, other, other_seeds, **kwargs), together]
    assert sample_seed(3, 0, 11, 0) != sample_seed(3, 1, 11, 0) != sample_seed(3, 0, 12, 0)


def test_gumbel_noise_samples_the_softmax():
    """argmax(logits + per-sample Gumbel) is distributed as softmax(logits)."""
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    n = 4000
    picks = torch.zeros(4)
    for s in range(n):
        picks[int(PerSampleGumbel([s])(None, logits).argmax())] += 1
    assert torch.allclose(picks / n, torch.softmax(logits[0], -1), atol=0.025)


def test_sampled_tokens_follow_the_softmax_the_loss_scores_at_that_temperature():
    """Through generate (temperature warper + per-sample Gumbel): the first sampled token's
    frequencies equal exp(token_logprobs) at the same temperature, the log-prob the loss reads."""
    model = _tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # a peaked distribution, so a temperature mix-up shows
    prompt, temperature, n = [1, 5, 9, 7], 0.5, 3000
    firsts = [
        g[0]
        for g in sample_groups(
            model,
            [prompt],
            [[sample_seed(0, 0, 0, k) for k in range(n)]],
            max_new_tokens=1,
            temperature=temperature,
            top_p=1.0,
            eos_id=2,
            pad_id=0,
            lockstep=False,
        )[0]
    ]
    candidates = torch.tensor([prompt + [t] for t in range(40)])
    with torch.no_grad():
        probs = token_logprobs(model, candidates, torch.ones_like(candidates), temperature)[:, -1].exp()
    assert abs(float(probs.sum()) - 1) < 1e-4 and float(probs.max()) > 0.3, probs
    frequencies = torch.bincount(torch.tensor(firsts), minlength=40) / n
    assert torch.allclose(frequencies, probs, atol=0.03), (frequencies, probs)


# ---------------------------------------------------------------- the loss, against TRL


def test_token_loss_and_gradient_equal_trl_grpo_trainer_compute_loss():
    """TRL's GRPOTrainer._compute_loss (loss_type dapo: summed over the completion tokens of the
    batch / their count) on the same log-probabilities, advantages, old and reference values."""
    trainer_mod = pytest.importorskip("trl.trainer.grpo_trainer")
    torch.manual_seed(0)
    b, t, beta, eps = 6, 5, 0.04, 0.2
    logps = (torch.randn(b, t) * 0.5 - 1.0).requires_grad_(True)
    old = logps.detach() + torch.randn(b, t) * 0.3  # ratios well outside 1 ± eps: clipping active
    ref = logps.detach() + torch.randn(b, t) * 0.2
    advantages = torch.randn(b)
    mask = (torch.rand(b, t) > 0.25).float()
    mask[:, 0] = 1

    fake = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros(b, t), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        loss_type="dapo",
        epsilon_low=eps,
        epsilon_high=eps,
        use_vllm=False,
        model=types.SimpleNamespace(training=True),
        accelerator=types.SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x),
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    inputs = {
        "prompt_ids": torch.ones(b, 2, dtype=torch.long),
        "prompt_mask": torch.ones(b, 2, dtype=torch.long),
        "completion_ids": torch.ones(b, t, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    trl_loss = trainer_mod.GRPOTrainer._compute_loss(fake, None, inputs)
    (trl_grad,) = torch.autograd.grad(trl_loss, logps)

    per_token, _ = grpo_token_loss(logps, old, advantages[:, None], ref, beta, eps)
    ours = (per_token * mask).sum() / mask.sum()
    (our_grad,) = torch.autograd.grad(ours, logps)
    assert abs(ours.item() - trl_loss.item()) < 1e-6
    assert torch.allclose(our_grad, trl_grad, atol=1e-7)


def test_a_grpo_step_raises_the_rewarded_completion_and_lowers_the_others():
    """One SGD step on GRPOTask.loss over a collated group (right padding, completions of
    different lengths, one cut without EOS): the masked log-probs the loss reads are each
    completion's own (logits at t score token t+1, prompt and padding left out), and the step
    raises the log-probability of the rewarded completion and lowers the others'."""
    model = _tiny_llama()
    raw = json.loads(
        json.dumps({**TINY_RECIPE, "task": "grpo", "grpo": {"group_size": 4, "max_new_tokens": 4, "beta": 0.0}})
    )
    raw["data"]["add_bos"] = "never"
    task = GRPOTask(types.SimpleNamespace(eos_token_id=2, pad_token_id=0), task_config(validate_recipe(raw)))
    prompt, completions = [1, 5, 9, 7], [[11, 12, 2], [13, 2], [14, 15, 16, 17], [18, 19, 2]]
    rollout = Rollout(prompt, completions, {"prompt": "p", "completion": "42"}, ["42", "7", "4242", " x"])
    task._score(rollout, 0)  # exact match: only the first is right
    assert rollout.advantages[0] > 0 > float(rollout.advantages[1:].max())

    def own_logps() -> torch.Tensor:  # each (prompt + completion) alone, unpadded
        with torch.no_grad():
            rows = [
                model(torch.tensor([prompt + c])).logits[0, len(prompt) - 1 : -1].log_softmax(-1) for c in completions
            ]
            return torch.stack([row.gather(-1, torch.tensor(c)[:, None]).sum() for row, c in zip(rows, completions)])

    before = own_logps()
    batch = task._collate_groups([rollout], with_logps=True)
    masked = (token_logprobs(model, batch["input_ids"], batch["attention_mask"], 1.0) * batch["completion_mask"]).sum(1)
    assert torch.allclose(masked.detach(), before, atol=1e-5), (masked, before)
    out = task.loss(model, batch)
    assert int(out.num_targets) == sum(len(c) for c in completions)
    (out.loss_sum / out.num_targets).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    change = own_logps() - before
    assert change[0] > 0 and bool((change[1:] < 0).all()), change


def test_a_group_gets_the_sampling_policys_log_probs_of_its_completion_positions():
    """The sampling policy's per-token log-probs of a group (num_iterations > 1: the ratios'
    denominator; completions of different lengths, right-padded): its (G, longest
    completion) rows equal the log-probs of each sequence alone."""
    model = _tiny_llama()
    raw = json.loads(
        json.dumps(
            {
                **TINY_RECIPE,
                "task": "grpo",
                "grpo": {"group_size": 2, "max_new_tokens": 4, "beta": 0.04, "num_iterations": 2},
            }
        )
    )
    raw["data"]["add_bos"] = "never"
    task = GRPOTask(types.SimpleNamespace(eos_token_id=2, pad_token_id=0), task_config(validate_recipe(raw)))
    task.policy = model
    prompt, completions = [1, 8, 3, 6, 4], [[14, 15, 16, 17], [18, 2]]
    rollout = Rollout(prompt, completions, {}, [])
    task._add_old_logps(model, [rollout])

    def alone(completion) -> torch.Tensor:
        with torch.no_grad():
            logps = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        return logps.gather(-1, torch.tensor(completion)[:, None])[:, 0]

    assert rollout.old_logps.shape == (2, 4)
    for j, c in enumerate(completions):
        assert torch.allclose(rollout.old_logps[j, : len(c)], alone(c), atol=1e-5)


def test_while_the_policy_is_the_reference_the_kl_term_adds_exactly_no_gradient():
    """The reference's log-probs are taken in the loss over the loss's own batch (same shapes,
    same floats). At the first step (policy = reference) the KL term's gradient is then
    exactly zero: rounding noise there is what AdamW turns into full-size steps whose sign
    depends on the split of the batch (1 and 2 processes ended 0.01 apart). Two groups of
    different prompt lengths in one micro-batch, every advantage 0: no gradient at all."""
    model = _tiny_llama()
    raw = json.loads(
        json.dumps({**TINY_RECIPE, "task": "grpo", "grpo": {"group_size": 2, "max_new_tokens": 4, "beta": 0.04}})
    )
    raw["data"]["add_bos"] = "never"
    task = GRPOTask(types.SimpleNamespace(eos_token_id=2, pad_token_id=0), task_config(validate_recipe(raw)))
    task.policy, task.reference = model, copy.deepcopy(model).requires_grad_(False).eval()
    groups = [
        Rollout([1, 8, 3, 6, 4], [[14, 15, 16, 17], [18, 2]], {}, []),
        Rollout([5, 9], [[20, 21, 22], [23]], {}, []),
    ]
    for g in groups:
        g.advantages = torch.zeros(2)
    out = task.loss(model, task._collate_groups(groups, with_logps=True))
    out.loss_sum.backward()
    assert float(out.metrics["kl"]) == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_a_groups_log_probs_are_the_same_floats_alone_or_beside_other_groups():
    """The loss batches the groups of one padded width (on the CPU), where a micro-batch holds
    a different set of groups on each world size: each group's log-probabilities (policy and
    reference passes alike) must be the floats it gets alone, to the last bit."""
    model = _tiny_llama().train()
    raw = json.loads(
        json.dumps({**TINY_RECIPE, "task": "grpo", "grpo": {"group_size": 2, "max_new_tokens": 4, "beta": 0.04}})
    )
    raw["data"]["add_bos"] = "never"
    task = GRPOTask(types.SimpleNamespace(eos_token_id=2, pad_token_id=0), task_config(validate_recipe(raw)))
    task.policy = model
    groups = [
        Rollout([1, 8, 3, 6, 4], [[14, 15, 16, 17], [18, 2]], {}, []),
        Rollout([5, 9], [[20, 21, 22], [23]], {}, []),  # a narrower pass
        Rollout([1, 7, 3, 6, 4, 9, 10, 11, 12], [[24, 25, 26], [27, 28, 29, 30]], {}, []),  # the first's width
        Rollout(list(range(3, 17)), [[31, 32], [33, 34, 35, 36]], {}, []),  # a wider pass
    ]
    for g in groups:
        g.advantages = torch.zeros(2)

    def logps(batch):
        return task._group_logps(lambda p: completion_logprobs(model, p, 1.0), batch)

    together = logps(task._collate_groups(groups, with_logps=True))
    for k, g in enumerate(groups):
        alone = task._collate_groups([g], with_logps=True)
        width = alone["completion_mask"].shape[1]
        mask = alone["completion_mask"].bool()
        assert torch.equal(logps(alone)[mask], together[2 * k : 2 * k + 2, :width][mask]), k


# ---------------------------------------------------------------- rewards and bad input


def bad_reward(prompts, completions, **columns):
    raise ValueError("boom")


def nan_reward(prompts, completions, **columns):
    return [float("nan")] * len(completions)


def answer_length(prompts, completions, completion, **columns):
    return [float(len(c) == len(a)) for c, a in zip(completions, completion)]


def _group(completions):
    return Group(
        "1+2=",
        {"prompt": "1+2=", "completion": "3", "__source": "data.jsonl", "__row": 4},
        completions,
        [len(c) + 1 for c in completions],
    )


def test_builtin_and_callable_rewards_score_a_group():
    cfg = GRPOConfig(
        max_new_tokens=4,
        rewards=[
            {"kind": "exact_match"},
            {"kind": "regex", "pattern": r"\d+"},
            {"kind": "length"},
            {"kind": "function", "function": "test_grpo:answer_length"},
        ],
    )
    rewards = RewardFunctions(cfg)
    assert rewards.names == ["exact_match", "regex", "length", "answer_length"]
    scores = rewards.score(_group(["3", " 3 ", "x3", "12"]))
    assert scores.tolist() == [[1, 1, 0, 0], [1, 0, 0, 1], [-0.5, -1.0, -0.75, -0.75], [1, 0, 0, 0]]


@pytest.mark.parametrize(
    "function, words",
    [
        ("test_grpo:bad_reward", ["test_grpo:bad_reward raised ValueError: boom", "data.jsonl: row 4"]),
        ("test_grpo:nan_reward", ["nan_reward returned nan", "data.jsonl: row 4"]),
    ],
)
def test_a_failing_reward_callable_is_one_line_naming_function_and_row(function, words):
    rewards = RewardFunctions(GRPOConfig(rewards=[{"kind": "function", "function": function}]))
    with pytest.raises(RewardFailed) as e:
        rewards.score(_group(["3", "4"]))
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def _recipe(**grpo):
    raw = {**TINY_RECIPE, "task": "grpo", "grpo": grpo}
    return validate_recipe(json.loads(json.dumps(raw)))


def test_bad_grpo_settings_are_one_line_each(tmp_path):
    for grpo, words in (
        ({"group_size": 1}, "grpo.group_size"),
        ({"max_new_tokens": 0}, "grpo.max_new_tokens"),
        ({"rewards": [{"kind": "exact"}]}, "grpo.rewards"),
    ):
        with pytest.raises(RecipeError) as e:
            _recipe(**grpo)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(UserInputError, match=r"grpo.rewards\[0\].function: cannot import 'no_such_module'"):
        RewardFunctions(GRPOConfig(rewards=[{"kind": "function", "function": "no_such_module:f"}]))

    from transformers import LlamaConfig, LlamaForSequenceClassification

    causal = tmp_path / "causal"
    _tiny_llama().save_pretrained(causal)
    two = tmp_path / "two"
    LlamaForSequenceClassification(
        LlamaConfig(
            vocab_size=40,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_labels=2,
        )
    ).save_pretrained(two)
    for folder, words in (
        (causal, "is not a sequence classifier"),
        (two, "has 2 outputs"),
        (tmp_path / "none", "is not a model folder"),
    ):
        with pytest.raises(UserInputError, match=words):
            RewardFunctions(GRPOConfig(rewards=[{"kind": "model", "path": str(folder)}]))


def test_reward_model_folder_scores_prompt_and_completion(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from accord.models.build import build_tokenizer
    from accord.recipe.schema import ModelConfig

    folder = tmp_path / "rm"
    tokenizer = build_tokenizer(ModelConfig(config={"architecture": "llama"}, tokenizer="byte"))
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_labels=1,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rewards = RewardFunctions(GRPOConfig(rewards=[{"kind": "model", "path": str(folder)}]))
    rewards.load(torch.device("cpu"))
    scores = rewards.score(_group(["3", "45"]))[0]
    with torch.no_grad():
        expected = [model(**tokenizer(["1+2=" + c], return_tensors="pt")).logits[0, 0].item() for c in ("3", "45")]
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)


def test_missing_prompt_column_stops_before_training(tmp_path):
    from accord.launch.preflight import prepare_and_check_data

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(8)))
    raw = {
        **TINY_RECIPE,
        "task": "grpo",
        "data": {"train": str(data), "max_length": 32, "cache_dir": str(tmp_path / "cache")},
        "batch": {"global_batch_size": 4},
        "grpo": {"max_new_tokens": 8},
    }
    problems = prepare_and_check_data(validate_recipe(json.loads(json.dumps(raw))))
    assert len(problems) == 1 and "missing field 'prompt'" in problems[0], problems


def test_chat_rows_prompt_with_the_chat_template_up_to_the_last_user_turn():
    """A `messages` row (as chat SFT data has them: the answer as the last turn) becomes the
    chat template of its turns before the closing assistant turn plus the generation prompt;
    the rewards see that prompt text."""
    import datasets

    from accord.models.build import build_tokenizer
    from accord.recipe.schema import ModelConfig
    from accord.tasks.grpo import GRPOTask

    tokenizer = build_tokenizer(ModelConfig(config={"architecture": "llama"}, tokenizer="byte"))
    task = GRPOTask(tokenizer, task_config(_recipe(max_new_tokens=4, rewards=[{"kind": "regex", "pattern": ".*"}])))
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "SECRET"},
    ]
    rows = datasets.Dataset.from_list([{"messages": conversation}])
    train, _ = task.fit(rows, None)
    encoded = task.encode_batch(train[:1])
    expected = tokenizer.apply_chat_template(conversation[:3], tokenize=False, add_generation_prompt=True)
    assert "2+2?" in expected and "SECRET" not in expected
    assert task.prompt_text(rows[0]) == expected
    assert encoded["prompt_ids"][0] == task.prefix + tokenizer(expected, add_special_tokens=False)["input_ids"]


SEEN: list[tuple[str, str]] = []


def record_completion(prompts, completions, **columns):
    SEEN.extend(zip(prompts, completions))
    return [0.0] * len(completions)


def test_greedy_eval_batches_prompts_of_one_length_and_completes_each_as_alone():
    """Held-out prompts of one length share a generate call: each completion is the one greedy
    decoding gives the prompt alone; padding rows (which keep ranks in step) are not scored."""
    from accord.models.build import build_tokenizer
    from accord.recipe.schema import ModelConfig
    from accord.tasks.base import PADDING

    tokenizer = build_tokenizer(ModelConfig(config={"architecture": "llama"}, tokenizer="byte"))
    model = _tiny_llama(vocab=len(tokenizer))
    recipe = _recipe(max_new_tokens=6, rewards=[{"kind": "function", "function": "test_grpo:record_completion"}])
    task = GRPOTask(tokenizer, task_config(recipe))
    prompts = ["1+2=", "13+4=", "5+6=", "99+9=", "7+8=", "40+1="]
    rows = [{k: v[0] for k, v in task.encode_batch({"prompt": [p], "completion": ["0"]}).items()} for p in prompts]
    rows.append({**rows[0], PADDING: True})

    def alone(row) -> str:
        ids = torch.tensor([row["prompt_ids"]])
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=task.pad_id,
            eos_token_id=task.eos_id,
            temperature=None,
            top_p=None,
            top_k=None,
        )[0, ids.shape[1] :].tolist()
        out = out[: out.index(task.eos_id)] if task.eos_id in out else out
        return tokenizer.decode(out, skip_special_tokens=True)

    SEEN.clear()
    sums = task.evaluate_generation(model, rows, torch.device("cpu"), 6)
    assert sums["count"] == len(prompts)
    assert sorted(SEEN) == sorted((p, alone(row)) for p, row in zip(prompts, rows))
    assert len({c for _, c in SEEN}) > 1, "a model that writes one completion for every prompt tests nothing"


# ---------------------------------------------------------------- runs (slow tier)

GRPO_RUN = {
    **TINY_RECIPE,
    "task": "grpo",
    "data": {
        "generate": {"kind": "addition", "train_examples": 64, "eval_examples": 8, "max_digits": 2},
        "max_length": 32,
    },
    "batch": {"global_batch_size": 4, "micro_batch_size": 2},
    "optim": {"lr": 3.0e-3, "warmup_steps": 0, "schedule": "constant", "max_grad_norm": 1.0},
    "train": {"max_steps": 4, "log_every": 1},
    "grpo": {
        "group_size": 4,
        "max_new_tokens": 5,
        "beta": 0.04,
        "rewards": [{"kind": "regex", "pattern": ".*[a-z].*"}, {"kind": "length", "weight": 0.5}],
    },
}


def _samples(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def _train(tmp_path: Path, name: str, *overrides: str) -> Path:
    recipe = write_recipe(
        tmp_path / f"{name}.yaml", {**GRPO_RUN, "data": {**GRPO_RUN["data"], "cache_dir": str(tmp_path / "cache")}}
    )
    out = tmp_path / name
    assert_ok(run_accord("train", recipe, f"output.dir={out}", *overrides, timeout=600))
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_grpo_update_is_the_same_on_one_and_two_processes(tmp_path):
    """1 × 4 prompts (no accumulation) against 2 processes × 1 prompt × 2 accumulation steps:
    same completions (rank 0 writes its own prompts' samples) and final parameters ≤ 1e-5.
    With num_iterations=2 (ratios against the sampling policy's log-probabilities); the
    resume test below covers num_iterations=1 across world sizes."""
    one = _train(tmp_path, "one", "engine.processes=1", "batch.micro_batch_size=4", "grpo.num_iterations=2")
    two = _train(tmp_path, "two", "engine.processes=2", "batch.micro_batch_size=1", "grpo.num_iterations=2")
    assert max_param_diff(final_params(one), final_params(two)) <= 1e-5
    by_two = {(s["step"], s["prompt"], s["completion"]) for s in _samples(two)}
    assert by_two and by_two <= {(s["step"], s["prompt"], s["completion"]) for s in _samples(one)}
    steps = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines() if '"kind": "train"' in line]
    for key in (
        "reward",
        "reward_regex",
        "reward_length",
        "reward_std",
        "kl",
        "clip_fraction",
        "completion_length",
        "generation_s",
        "training_s",
    ):
        assert all(math.isfinite(s[key]) for s in steps), key
    assert [s["step"] for s in _samples(one)][::16] == [1, 2, 3, 4]  # 4 prompts × G=4 each step
    unstepped = [{k: v for k, v in s.items() if k != "step"} for s in _samples(one)]
    assert unstepped[:16] == unstepped[16:32]  # step 2 trains on step 1's generation batch
    assert steps[1]["clip_fraction"] > 0 or steps[3]["clip_fraction"] > 0  # the second step's ratios moved


@pytest.mark.slow
@pytest.mark.distributed
def test_grpo_resumed_on_another_world_size_continues_with_the_same_completions(tmp_path):
    full = _train(tmp_path, "full", "engine.processes=2", "batch.micro_batch_size=1", "checkpoint.every_steps=2")
    resumed = _train(
        tmp_path,
        "resumed",
        "engine.processes=1",
        "batch.micro_batch_size=4",
        f"resume={full / 'checkpoints' / 'step-000002'}",
    )
    assert max_param_diff(final_params(full), final_params(resumed)) <= 1e-5
    later = {(s["step"], s["prompt"], s["completion"]) for s in _samples(full) if s["step"] > 2}
    assert later and later <= {(s["step"], s["prompt"], s["completion"]) for s in _samples(resumed)}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_grpo_generates_in_lockstep_under_sharded_strategies(tmp_path, strategy):
    """Ranks finish their completions at different lengths; the sharded forwards stay in step
    and the update equals the ddp run's."""
    pytest.importorskip("deepspeed") if strategy == "zero3" else None
    ddp = _train(tmp_path, "ddp", "engine.processes=2", "train.max_steps=2")
    sharded = _train(tmp_path, strategy, "engine.processes=2", "train.max_steps=2", f"engine.strategy={strategy}")
    assert max_param_diff(final_params(ddp), final_params(sharded)) <= 1e-5


@pytest.mark.distributed
def test_a_reward_callable_that_raises_stops_the_run_with_one_line(tmp_path):
    """End to end (the default tier's one process-starting grpo test): the worker's reward
    failure is agreed over the ranks and ends the run with one line naming function and row."""
    (tmp_path / "myrewards.py").write_text(
        "def picky(prompts, completions, **columns):\n    raise KeyError('answer')\n"
    )
    raw = {
        **GRPO_RUN,
        "data": {**GRPO_RUN["data"], "cache_dir": str(tmp_path / "cache")},
        "engine": {**GRPO_RUN["engine"], "processes": 1},
        "train": {"max_steps": 2, "log_every": 1},
        "grpo": {
            **GRPO_RUN["grpo"],
            "max_new_tokens": 2,
            "rewards": [{"kind": "function", "function": "myrewards:picky"}],
        },
    }
    recipe = write_recipe(tmp_path / "r.yaml", raw)
    proc = run_accord("train", recipe, f"output.dir={tmp_path / 'out'}", cwd=tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("accord: error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert (
        "reward function myrewards:picky raised KeyError: 'answer' on " in errors[0]
        and "data row " in errors[0]
        and "(prompt '" in errors[0]
    ), errors[0]
    assert "Traceback" not in proc.stderr
