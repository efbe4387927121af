"""The final model in `final/` (a save_pretrained folder plain transformers loads), and with
LoRA the adapter alone in `adapter/` (peft's layout, naming a base it loads from), merged
into the weights for `final/` by default, and the base in `base/` when it is in no lasting
folder already.

Nothing is gathered whole: the engine hands over one tensor at a time (a sharded one
gathered just then), rank 0 appends it to the current safetensors shard and writes each
shard when it is full. A LoRA layer is merged as its three tensors arrive (W + B·A·scale)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import torch

from accord.distributed import group as dist
from accord.models.build import adapter_base, adapter_saving
from accord.output.folder import save_final_model, save_streamed_model, streamed_model
from accord.recipe.schema import Recipe

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"  # peft's name for the one adapter accord trains


def export_final(engine, recipe: Recipe, task, tokenizer, out_dir: Path, info: dist.DistInfo) -> Path:
    """Collective: every rank takes part in gathering each sharded tensor; rank 0 writes."""
    final = out_dir / "final"
    # A vision-language model's processor (image processor, chat template and tokenizer), so
    # that AutoProcessor loads final/ as it loads the model.
    tokenizer = getattr(task, "processor", None) or tokenizer
    tensors = engine.full_tensors(writer=info.is_main)
    if not info.is_main:
        for _ in tensors:  # the same collectives as the writer, in the same order
            pass
    elif recipe.lora is None:
        save_streamed_model(tensors, engine.module, tokenizer, final)
    else:
        _export_lora(tensors, engine.module, recipe, tokenizer, out_dir)
    dist.barrier()
    return final


def _export_lora(tensors, module, recipe: Recipe, tokenizer, out_dir: Path) -> None:
    """final/ (merged, or the adapter alone), adapter/, and base/ when no lasting folder holds
    the base as trained (see adapter_base): all from one pass over the tensors."""
    adapter: dict[str, torch.Tensor] = {}
    named = adapter_base(recipe.model)
    base_folder = out_dir / "base"
    with streamed_model(module.get_base_model(), tokenizer, base_folder) if named is None else nullcontext() as add:
        tensors = _keeping_adapter(tensors, adapter)
        if add is not None:
            tensors = _writing_base(tensors, add)
        if recipe.lora.merge_on_export:
            save_streamed_model(merged_lora(tensors, module), module.get_base_model(), tokenizer, out_dir / "final")
        else:
            for _ in tensors:
                pass
    name, revision = named or (str(base_folder.resolve()), None)
    config = module.peft_config[ADAPTER]
    config.base_model_name_or_path, config.revision = name, revision
    base_config = module.get_base_model().config
    source = base_config.name_or_path
    base_config.name_or_path = name  # what peft's README names as base_model
    try:
        with adapter_saving():
            save_final_model(module, tokenizer, out_dir / "adapter", state_dict=adapter)
            if not recipe.lora.merge_on_export:
                save_final_model(module, tokenizer, out_dir / "final", state_dict=adapter)
    finally:
        base_config.name_or_path = source


def _writing_base(tensors, add) -> Iterator[tuple[str, torch.Tensor]]:
    """Passes the tensors on, handing the base model's own (the frozen weights under the
    adapters, the original of each module_to_save) to `add` under the base model's names."""
    for name, tensor in tensors:
        if ".lora_" not in name and ".modules_to_save." not in name:
            add(_base_name(name).replace(".original_module.", "."), tensor)
        yield name, tensor


def _keeping_adapter(tensors, adapter: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Passes the tensors on, keeping a copy of the adapter's own (small) in `adapter`."""
    for name, tensor in tensors:
        if ".lora_" in name or ".modules_to_save." in name:
            adapter[name] = tensor
        yield name, tensor


def merged_lora(tensors, module) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft model's tensors (state-dict order) as the merged base model's: each LoRA layer's
    weight W + (B @ A) * scale (transposed for fan_in_fan_out layers; per expert for an adapter
    on a mixture-of-experts model's fused expert parameter), named as in the base model; the
    trained copies of modules_to_save replace the originals. At most one layer's tensors wait
    for their partners."""
    from peft.tuners.lora import LoraLayer

    from accord.compat.peft import is_parameter_adapter, parameter_delta, parameter_name

    layers = {name: m for name, m in module.named_modules() if isinstance(m, LoraLayer)}
    for name, layer in layers.items():
        if layer.use_dora.get(ADAPTER) or getattr(layer, "lora_embedding_A", {}).get(ADAPTER) is not None:
            raise NotImplementedError(f"{name}: merging DoRA or embedding adapters on export is not supported")
    # An adapted parameter's own name, without the wrappers' base_layer hops -> its adapter layer.
    parameters = {
        f"{_unwrapped(prefix)}.{parameter_name(layer)}": prefix
        for prefix, layer in layers.items()
        if is_parameter_adapter(layer)
    }
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    parts = {".base_layer.weight": "W", f".lora_A.{ADAPTER}.weight": "A", f".lora_B.{ADAPTER}.weight": "B"}
    for name, tensor in tensors:
        if ".lora_" not in name and _unwrapped(name) in parameters:
            part = (parameters[_unwrapped(name)], "W")
        else:
            part = next(
                (
                    (prefix, kind)
                    for suffix, kind in parts.items()
                    if name.endswith(suffix) and (prefix := name[: -len(suffix)]) in layers
                ),
                None,
            )
        if part is None:
            if ".original_module." in name or ".lora_" in name:
                continue
            yield _base_name(name), tensor
            continue
        prefix, kind = part
        got = waiting.setdefault(prefix, {})
        got[kind] = tensor
        if kind == "W":
            got["name"] = name
        if len(got) == 4:
            del waiting[prefix]
            layer = layers[prefix]
            if is_parameter_adapter(layer):
                delta = parameter_delta(layer, got["A"].float(), got["B"].float(), layer.scaling[ADAPTER])
            else:
                delta = got["B"].float() @ got["A"].float()
                delta = (delta.T if layer.fan_in_fan_out else delta) * layer.scaling[ADAPTER]
            yield _base_name(got["name"]), (got["W"].float() + delta).to(got["W"].dtype)
    if waiting:
        raise RuntimeError(f"LoRA layers without all their tensors on export: {', '.join(sorted(waiting)[:3])}")


def _unwrapped(name: str) -> str:
    """A name with peft's wrapping taken out: its prefix and every base_layer hop."""
    return re.sub(r"(\.base_layer)+(?=\.|$)", "", name.removeprefix(PEFT_PREFIX))


def _base_name(name: str) -> str:
    name = re.sub(r"(\.base_layer)+\.", ".", name.removeprefix(PEFT_PREFIX))
    return name.replace(f".modules_to_save.{ADAPTER}.", ".")
