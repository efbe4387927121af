"""Canaries for accord.compat: one per reach-in to another library's private API. Each checks
that the private thing still exists and behaves as accord assumes, so that upgrading a
library fails here, with a message saying what changed, before it fails inside a run."""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys

import pytest

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")


# ---------------------------------------------------------------- DeepSpeed


@pytest.fixture(scope="module")
def deepspeed_classes():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedEngine, DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3


def _assigns(cls, attribute: str) -> bool:
    """Whether `cls`'s source sets `self.<attribute>` (an instance attribute made in __init__
    or a method it calls: checked without building a distributed engine)."""
    return f"self.{attribute} =" in inspect.getsource(cls)


@needs_deepspeed
def test_deepspeed_is_a_version_compat_deepspeed_was_written_for(deepspeed_classes):
    from accord.compat import deepspeed as ds_compat

    assert ds_compat.untested_version() is None, (
        f"DeepSpeed {ds_compat.untested_version()} is newer or older than accord.compat.deepspeed.WRITTEN_FOR "
        f"({ds_compat.written_for()}): check the canaries below pass, then widen WRITTEN_FOR"
    )


@needs_deepspeed
def test_deepspeed_engine_keeps_the_base_optimizer(deepspeed_classes):
    engine, _, _ = deepspeed_classes
    assert _assigns(engine, "basic_optimizer"), "DeepSpeedEngine no longer keeps `basic_optimizer` (base_optimizer)"


@needs_deepspeed
def test_deepspeed_zero12_relinks_its_optimizer_state_views_on_request(deepspeed_classes):
    _, zero, _ = deepspeed_classes
    relink = getattr(zero, "_lazy_init_hp_params_optimizer_state", None)
    assert callable(relink), "DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state is gone (relink)"
    assert list(inspect.signature(relink).parameters) == ["self"]
    # relink_optimizer_state clears this flag so that the method links again.
    assert "self._hp_optimizer_states_linked" in inspect.getsource(relink), (
        "_lazy_init_hp_params_optimizer_state no longer checks _hp_optimizer_states_linked"
    )
    assert _assigns(zero, "_hp_optimizer_states_linked")


@needs_deepspeed
def test_deepspeed_zero3_keeps_its_flat_partitions(deepspeed_classes):
    _, _, stage3 = deepspeed_classes
    for name in ("fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat"):
        assert _assigns(stage3, name), f"DeepSpeedZeroOptimizer_Stage3 no longer keeps `{name}`"


@needs_deepspeed
@pytest.mark.parametrize("which", [1, 2])
def test_deepspeed_loss_scale_is_readable_and_settable(deepspeed_classes, which):
    cls = deepspeed_classes[which]
    prop = inspect.getattr_static(cls, "loss_scale", None)
    assert isinstance(prop, property) and prop.fset is not None, f"{cls.__name__}.loss_scale has no setter"


@needs_deepspeed
def test_deepspeed_zero3_still_copies_fp32_partitions_it_could_reuse(deepspeed_classes):
    """The comparison reuse_fp32_partitions works around: a `torch.device` against the
    optimizer's device name. If DeepSpeed compares properly, the swap is a no-op."""
    import torch

    _, _, stage3 = deepspeed_classes
    create = getattr(stage3, "_create_fp32_partitions", None)
    assert callable(create), "DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions is gone: fp32 partitions are copied"
    assert list(inspect.signature(create).parameters) == ["self"]
    source = inspect.getsource(create)
    assert ".device == self.device" in source, "DeepSpeed changed how ZeRO-3 decides to reuse fp32 partitions"
    assert "current_device_name()" in inspect.getsource(stage3.__init__), "ZeRO-3's device is no longer a name"
    assert torch.device("cpu") != "cpu", "torch now compares a device with its name: the swap is not needed"


@needs_deepspeed
def test_reuse_fp32_partitions_swaps_the_method_only_while_it_lasts(deepspeed_classes):
    from accord.compat.deepspeed import reuse_fp32_partitions

    _, _, stage3 = deepspeed_classes
    original = stage3._create_fp32_partitions
    with reuse_fp32_partitions(True):
        assert stage3._create_fp32_partitions is not original
    assert stage3._create_fp32_partitions is original
    with reuse_fp32_partitions(False):  # an fp16 run: its partitions are no fp32 copy to spare
        assert stage3._create_fp32_partitions is original


# DeepSpeed's autotuner sets has_mlflow on import (True, with mlflow loaded, wherever mlflow is installed).
_IMPORTS = """
import os, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
from accord.compat.deepspeed import import_deepspeed
import_deepspeed()
print("mlflow" in sys.modules, sys.modules["deepspeed.autotuning.autotuner"].has_mlflow)
import mlflow.tracking  # as the mlflow tracker does, afterwards
"""


@needs_deepspeed
@pytest.mark.subprocess
@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed")
def test_deepspeed_is_imported_without_its_autotuners_mlflow_and_mlflow_still_imports_after():
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "False"]


def test_a_missing_deepspeed_internal_is_one_line_naming_the_version():
    from accord.compat import IncompatibleLibrary
    from accord.compat import deepspeed as ds_compat

    class DeepSpeedZeroOptimizer:
        pass

    with pytest.raises(IncompatibleLibrary) as error:
        ds_compat.relink_optimizer_state(DeepSpeedZeroOptimizer())
    message = str(error.value)
    assert "\n" not in message
    assert "DeepSpeedZeroOptimizer has no attribute '_hp_optimizer_states_linked'" in message
    assert f"written for DeepSpeed {ds_compat.written_for()}" in message


# ---------------------------------------------------------------- torch


def test_torch_module_tables_are_what_the_module_uses():
    import torch
    from torch import nn

    from accord.compat.torch import buffer_table, is_persistent_buffer, parameter_table

    module = nn.Linear(2, 2)
    module.register_buffer("kept", torch.zeros(1))
    module.register_buffer("scratch", torch.zeros(1), persistent=False)
    assert set(parameter_table(module)) == {"weight", "bias"}
    assert set(buffer_table(module)) == {"kept", "scratch"}
    replacement = nn.Parameter(torch.ones(2, 2))
    parameter_table(module)["weight"] = replacement
    assert module.weight is replacement and dict(module.named_parameters())["weight"] is replacement
    buffer_table(module)["kept"] = torch.ones(1)
    assert module.kept.item() == 1.0
    assert is_persistent_buffer(module, "kept") and not is_persistent_buffer(module, "scratch")
    assert set(module.state_dict()) == {"weight", "bias", "kept"}


def test_torch_calls_an_instance_forward_inside_the_module_hooks():
    import torch
    from torch import nn

    from accord.compat.torch import replace_forward

    module = nn.Linear(2, 2)
    calls = []
    module.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    module.register_forward_hook(lambda m, args, out: calls.append("post"))
    replace_forward(module, lambda x: calls.append("forward") or x * 2)
    assert torch.equal(module(torch.ones(1, 2)), torch.full((1, 2), 2.0))
    assert calls == ["pre", "forward", "post"]


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group exists already")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_torch_places_a_dtensor_shard_and_hands_its_storage(one_rank_group):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from accord.compat.torch import local_offset

    assert list(inspect.signature(compute_local_shape_and_global_offset).parameters)[:3] == [
        "global_shape",
        "mesh",
        "placements",
    ]
    mesh = init_device_mesh("cpu", (1,))
    tensor = distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)])
    assert local_offset(tensor) == (0, 0)
    with torch.no_grad():  # models.weights writes the shard in place through to_local()
        tensor.to_local().fill_(7.0)
    assert torch.equal(tensor.full_tensor(), torch.full((3, 2), 7.0))


def _lambda_lr(groups: int):
    import torch

    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(groups)]
    optimizer = torch.optim.SGD([{"params": [p]} for p in params], lr=1.0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)


def test_torch_scheduler_last_lr_can_be_set():
    from accord.compat.torch import set_last_lr

    scheduler = _lambda_lr(2)
    assert scheduler.get_last_lr() == [0.5, 0.5]
    set_last_lr(scheduler, [0.25, 0.25])
    assert scheduler.get_last_lr() == [0.25, 0.25]
    assert scheduler.state_dict()["_last_lr"] == [0.25, 0.25]


def test_torch_scheduler_state_lists_per_group_entries():
    from accord.compat.torch import SCHEDULER_GROUP_KEYS

    state = _lambda_lr(3).state_dict()
    for key in SCHEDULER_GROUP_KEYS:
        assert isinstance(state.get(key), list) and len(state[key]) == 3, f"LambdaLR's state has no per-group {key!r}"


@needs_deepspeed
def test_deepspeed_ulysses_attention_takes_accords_settings_and_its_core_name(deepspeed_classes):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    accepted = set(inspect.signature(UlyssesSPAttentionHF.__init__).parameters)
    settings = {"attn", "batch_size", "attn_head_count", "attn_head_size", "kv_head_count", "num_hidden_layers"}
    settings |= {"process_group", "seq_length_is_variable", "disable_in_eval"}
    assert settings <= accepted, f"UlyssesSPAttentionHF no longer takes {sorted(settings - accepted)}"
    assert _assigns(UlyssesSPAttentionHF, "core_attn_implementation")
    assert ".core_attn_implementation = core_attn_implementation" in inspect.getsource(
        UlyssesSPAttentionHF.register_with_transformers
    ), "DeepSpeed's register_with_transformers no longer names the core attention this way (ulysses_attention)"


# ---------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    )
    config.vocab_size = 32
    return LlamaForCausalLM(config)


def test_transformers_dispatches_attention_by_the_configs_implementation(tiny_llama):
    import torch
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from accord.compat.transformers import attn_implementation, set_attn_implementation

    config = tiny_llama.config
    core = attn_implementation(config)
    assert core == "sdpa"
    calls = []

    def counted(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append(module)
        return ALL_ATTENTION_FUNCTIONS[core](module, query, key, value, attention_mask, *args, **kwargs)

    AttentionInterface.register("accord_compat_canary", counted)
    AttentionMaskInterface.register("accord_compat_canary", ALL_MASK_ATTENTION_FUNCTIONS[core])
    set_attn_implementation(config, "accord_compat_canary")
    try:
        assert attn_implementation(config) == "accord_compat_canary"
        with torch.no_grad():
            tiny_llama(torch.tensor([[1, 2, 3]]))
        assert len(calls) == 1, "the attention layer did not dispatch to the implementation its config names"
    finally:
        set_attn_implementation(config, core)


def test_transformers_initialises_one_module_through_init_weights(tiny_llama):
    import torch

    from accord.compat.transformers import init_weights

    layer = tiny_llama.model.layers[0].mlp.up_proj
    with torch.no_grad():
        layer.weight.zero_()
    init = init_weights(tiny_llama)
    assert list(inspect.signature(init).parameters) == ["module"]
    init(layer)
    assert layer.weight.abs().sum() > 0, "_init_weights(module) no longer initialises the module it is given"


def test_transformers_names_the_blocks_not_to_split(tiny_llama):
    from accord.compat.transformers import no_split_modules

    assert no_split_modules(tiny_llama) == ["LlamaDecoderLayer"]


def test_transformers_generate_continues_from_a_prefilled_cache_shared_by_several_rows(tiny_llama):
    """GRPO prefills each prompt's keys and values once (all but the last token, left-padded)
    and hands them, one copy per completion, to generate under the cache argument's name:
    greedy decoding from there equals decoding the same rows from scratch."""
    import torch

    from accord.compat.transformers import cache_argument, prefill_cache

    assert cache_argument(tiny_llama) in inspect.signature(tiny_llama.forward).parameters
    ids = torch.tensor([[0, 0, 0, 1, 5, 9, 7, 11], [0, 0, 0, 0, 0, 1, 8, 3]])
    mask = (torch.arange(8)[None] >= torch.tensor([[3], [5]])).long()
    rows = torch.tensor([0, 0, 1, 1])
    settings = dict(
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        cache = prefill_cache(tiny_llama, ids[:, :-1], mask[:, :-1])
        cache.batch_select_indices(rows)
        shared = tiny_llama.generate(
            input_ids=ids[rows], attention_mask=mask[rows], **settings, **{cache_argument(tiny_llama): cache}
        )
        scratch = tiny_llama.generate(input_ids=ids[rows], attention_mask=mask[rows], **settings)
    assert shared.sequences.tolist() == scratch.sequences.tolist()
    assert torch.allclose(torch.stack(shared.logits), torch.stack(scratch.logits), atol=1e-5)


def _tiny_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        hidden_size=16, moe_intermediate_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    )
    config.vocab_size, config.num_experts, config.num_experts_per_tok = 32, 4, 2
    return Qwen3MoeForCausalLM(config)


def test_transformers_names_the_router_modules_of_a_mixture_of_experts_model(tiny_llama):
    from accord.compat.transformers import router_output

    model = _tiny_moe()
    is_router, index = router_output(model)
    assert [type(m).__name__ for m in model.modules() if is_router(m)] == ["Qwen3MoeTopKRouter"]
    assert index == 0 and router_output(tiny_llama) is None


def test_transformers_splits_the_experts_and_dispatches_to_them_on_an_ep_mesh(one_rank_group):
    """The expanded ep_plan and apply_expert_parallelism (engine.expert_parallel): the fused expert
    weights become DTensors on the EP mesh, the experts module takes the all-to-all dispatch, and
    the forward (one rank: every expert local) is the unsplit model's."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from accord.compat.transformers import EXPERT_STYLES, apply_expert_parallel, expert_plan

    torch.manual_seed(0)
    model = _tiny_moe()
    assert set(expert_plan(model.config).values()) == set(EXPERT_STYLES)
    ids = torch.tensor([[1, 5, 7, 2, 9]])
    with torch.no_grad():
        before = model(ids).logits
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "ep"))
    apply_expert_parallel(model, mesh["ep"], mesh["dp"])
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, DTensor) and experts._is_expert_parallel
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- peft


def test_peft_adapts_fused_expert_parameters_with_a_parameter_wrapper():
    import warnings

    from peft import LoraConfig, get_peft_model

    from accord.compat.peft import is_parameter_adapter, parameter_name

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(_tiny_moe(), LoraConfig(r=2, target_modules="all-linear"))
    experts = model.base_model.model.model.layers[0].mlp.experts
    assert is_parameter_adapter(experts) and parameter_name(experts) == "down_proj"
    assert experts.num_experts == 4 and isinstance(experts._did_swap_in_out_features, bool)


# ---------------------------------------------------------------- gguf


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="gguf is not installed")
def test_gguf_name_map_is_looked_up_per_call_and_cached_while_converting():
    import gguf
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from accord.compat.gguf import one_name_map_per_layout

    assert list(inspect.signature(gguf.get_tensor_name_map).parameters) == ["arch", "n_blocks"]
    # transformers imports the function from gguf where it uses it, so the cached one is what it calls.
    assert not hasattr(gguf_utils, "get_tensor_name_map"), "transformers now imports get_tensor_name_map once"
    assert "from gguf import" in inspect.getsource(gguf_utils) and "get_tensor_name_map(" in inspect.getsource(
        gguf_utils
    )
    plain = gguf.get_tensor_name_map
    arch = gguf.MODEL_ARCH.LLAMA
    with one_name_map_per_layout():
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert gguf.get_tensor_name_map is plain


# ---------------------------------------------------------------- C library


@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and Linux")
def test_libc_mallopt_is_callable():
    from accord.compat.libc import mallopt

    assert mallopt(-6, 0), "glibc's mallopt is missing or refused M_PERTURB=0 (its default)"  # -6: M_PERTURB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's madvise")
def test_libc_madvise_drops_the_pages_of_a_private_mapping():
    import ctypes
    import mmap

    from accord.compat.libc import madvise_dontneed

    release = madvise_dontneed()
    assert release is not None
    pages = mmap.mmap(-1, 4 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages.write(b"\x01" * len(pages))
    view = ctypes.c_char.from_buffer(pages)
    try:
        assert release(ctypes.addressof(view), len(pages))
    finally:
        del view
    assert pages[:] == bytes(len(pages)), "an anonymous page dropped by MADV_DONTNEED reads back as zeros"
    pages.close()


# ---------------------------------------------------------------- datasets


def test_datasets_keeps_a_fingerprint_and_an_indices_mapping():
    from datasets import Dataset

    from accord.compat.datasets import fingerprint, is_selection

    ds = Dataset.from_dict({"text": ["a", "b", "c"]})
    assert isinstance(fingerprint(ds), str) and fingerprint(ds)
    assert fingerprint(ds.map(lambda row: {"n": len(row["text"])})) != fingerprint(ds)
    assert not is_selection(ds)
    assert is_selection(ds.select([0, 2]))
    assert not is_selection(ds.select([0, 2]).flatten_indices())


def test_transformers_trainer_decay_groups_are_read_without_a_trainer(tiny_llama):
    """Trainer.get_decay_parameter_names reads nothing of the Trainer (called with None) and puts
    the linear weights in the decay group, norms out: a Trainer optimizer.pt's positions follow it."""
    from transformers import Trainer

    from accord.compat.transformers import trainer_decay_parameter_names

    source = inspect.getsource(Trainer.get_decay_parameter_names)
    assert "self." not in source.split(":", 1)[1].split('"""', 2)[-1], "get_decay_parameter_names now reads the Trainer"
    names = trainer_decay_parameter_names(tiny_llama)
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("norm" in name for name in names)
