"""transformers internals accord uses.

- the attention implementation a model's config selects (`config._attn_implementation`),
  read by the tasks, the planner and sequence parallelism, and set by sequence parallelism
  to the Ulysses attention it registers. transformers' public `set_attn_implementation`
  also re-dispatches every sub-model (a vision tower too) and checks the modeling code:
  accord sets the text model's config only, as it always has;
- each model's `_init_weights` (models.weights initialises a meta-device model one module
  at a time, as transformers' own initialisation dispatches to it);
- a model's `_no_split_modules`, the blocks FSDP wraps one by one (engine.wrapping);
- `Trainer.get_decay_parameter_names`, the rule that splits Trainer's AdamW into its weight-decay
  and no-decay groups (checkpoint.trainer_folder maps a Trainer optimizer.pt's positions to
  parameter names with it); a method that reads nothing of the Trainer, called without one;
- the name of the KV-cache argument of `forward` and `generate` (`past_key_values` before
  5.x renamed it `cache`), for GRPO's prompts prefilled once per group (tasks.rollout);
- the router modules a mixture-of-experts model records `output_router_logits` from
  (`_can_record_outputs["router_logits"]`), hooked by accord's balancing loss (models.moe);
- expert parallelism (`transformers.distributed.expert_parallel`, not re-exported): the model's
  `ep_plan` expanded per layer (`_expand_parallel_plan`) and `apply_expert_parallelism`, which
  shards the fused expert parameters over the expert-parallel mesh and dispatches the tokens
  to them with all-to-all (engine.expert_parallel).

Public API is used wherever it does the same: `config.name_or_path`, a fast tokenizer's
`backend_tokenizer`, AttentionInterface / AttentionMaskInterface registration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from accord.compat import incompatible

WRITTEN_FOR = "5.25"


def _missing(what: str, needed_by: str) -> Exception:
    import transformers

    return incompatible("transformers", transformers.__version__, what, needed_by, WRITTEN_FOR)


def _is_config(config: Any) -> bool:
    import transformers

    return isinstance(config, transformers.PretrainedConfig)


def attn_implementation(config: Any) -> str | None:
    """The attention implementation `config` selects (None where it names none)."""
    try:
        return config._attn_implementation
    except AttributeError:
        if _is_config(config):
            raise _missing(
                f"{type(config).__name__} has no '_attn_implementation'", "accord's attention set-up"
            ) from None
        return None


def set_attn_implementation(config: Any, name: str) -> None:
    """Every attention layer built from `config` dispatches to the attention registered as `name`."""
    from transformers import PretrainedConfig

    setting = getattr(PretrainedConfig, "_attn_implementation", None)
    if not isinstance(setting, property) or setting.fset is None:
        raise _missing("PretrainedConfig._attn_implementation is no settable property", "engine.sequence_parallel")
    config._attn_implementation = name


def init_weights(model: Any) -> Callable[[Any], None]:
    """The function that `model` (a PreTrainedModel) initialises one of its modules with."""
    try:
        return model._init_weights
    except AttributeError:
        raise _missing(f"{type(model).__name__} has no '_init_weights'", "accord's weight initialisation") from None


def no_split_modules(model: Any) -> list[str]:
    """The class names of the blocks `model` says must not be split (none: an empty list)."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel) and not hasattr(type(model), "_no_split_modules"):
        raise _missing("PreTrainedModel has no '_no_split_modules'", "accord's FSDP wrapping")
    return list(getattr(model, "_no_split_modules", None) or [])


def _forward_parameters(model: Any) -> Any:
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model's own forward
    return inspect.signature(base.forward).parameters


def cache_argument(model: Any) -> str:
    """The name under which `model.forward` and `model.generate` take a KV cache."""
    parameters = _forward_parameters(model)
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise _missing("a KV-cache argument of the model's forward (`cache` or `past_key_values`)", "grpo sampling")


def new_cache(model: Any) -> Any:
    """An empty DynamicCache for `model` (its layer kinds from its config)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def one_logit(model: Any) -> dict[str, int]:
    """The forward argument that keeps the logits of the last position only (a pass wanted for
    its cache need not make rows × length × vocabulary logits), where the model takes it."""
    return {"logits_to_keep": 1} if "logits_to_keep" in _forward_parameters(model) else {}


def generate_positions(attention_mask: Any) -> Any:
    """The position ids generate gives left-padded rows: counted from each row's first real
    token (0 on the padding)."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


def prefill_cache(model: Any, input_ids: Any, attention_mask: Any) -> Any:
    """A DynamicCache holding the keys and values of left-padded `input_ids`, at the positions
    generate gives them (counted from each row's first real token)."""
    import torch

    cache = new_cache(model)
    with torch.no_grad():
        model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=generate_positions(attention_mask),
            use_cache=True,
            **{cache_argument(model): cache},
            **one_logit(model),
        )
    return cache


def text_config(config: Any) -> Any:
    """The config of a model's text part (a multimodal model's language model; the config
    itself otherwise, and for a plain namespace standing in for one)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def trainer_decay_parameter_names(model) -> list[str]:
    """The parameters transformers.Trainer puts in its weight-decay group, in model order."""
    from transformers import Trainer

    method = getattr(Trainer, "get_decay_parameter_names", None)
    if method is None:
        raise _missing("Trainer.get_decay_parameter_names", "resuming from a Trainer checkpoint")
    return list(method(None, model))


def router_output(model: Any) -> tuple[Callable[[Any], bool], int] | None:
    """A mixture-of-experts model's router modules and where their output holds the router logits:
    (is a router module, index into its output), from the recorder the model declares for
    `output_router_logits` (`_can_record_outputs["router_logits"]`); None for a model without one."""
    recorders = getattr(type(model), "_can_record_outputs", None)
    if recorders is None:
        return None
    if not isinstance(recorders, dict):
        raise _missing("_can_record_outputs is no dict", "the MoE router statistics")
    recorder = recorders.get("router_logits")
    if recorder is None:
        return None
    if isinstance(recorder, type):
        return (lambda module: isinstance(module, recorder)), 0
    target, class_name, index = (getattr(recorder, name, None) for name in ("target_class", "class_name", "index"))
    if target is None and class_name is None:
        raise _missing("an OutputRecorder without target_class or class_name", "the MoE router statistics")

    def is_router(module: Any) -> bool:
        if target is not None:
            return isinstance(module, target)
        return type(module).__name__.endswith(class_name)

    return is_router, int(index or 0)


# The EP plan's styles accord runs: fused expert weights sharded on the expert dimension, and
# the experts module reached through transformers' token dispatch.
EXPERT_STYLES = ("grouped_gemm", "ep_dispatch_experts")


def expert_plan(config: Any) -> dict[str, str]:
    """The config's expert-parallel plan (module or parameter pattern -> style), relative to
    the base model; empty for a model without one."""
    return dict(getattr(text_config(config), "base_model_ep_plan", None) or {})


def apply_expert_parallel(model: Any, ep_mesh: Any, batch_mesh: Any) -> None:
    """Shard each MoE layer's experts over `ep_mesh` (its N ranks hold different rows) and send
    every routed token to its expert's rank and back with all-to-all (transformers'
    `AllToAllEP`). `batch_mesh`: the ranks that share one batch, of size 1 here (transformers
    calls it the TP mesh). On the meta device or on real storage."""
    try:
        from transformers.distributed.expert_parallel import apply_expert_parallelism
    except ImportError:
        what = "no transformers.distributed.expert_parallel.apply_expert_parallelism"
        raise _missing(what, "engine.expert_parallel") from None
    expand = getattr(model, "_expand_parallel_plan", None)
    plan = getattr(model, "ep_plan", None)
    if expand is None or plan is None:
        raise _missing(f"{type(model).__name__} has no ep_plan / _expand_parallel_plan", "engine.expert_parallel")
    apply_expert_parallelism(model, ep_mesh, batch_mesh, expand(plan), ep_implementation="all_to_all")
