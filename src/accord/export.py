"""The final model in `final/` (a save_pretrained folder plain transformers loads), and with
LoRA the adapter alone in `adapter/`, merged into the weights for `final/` by default."""

from __future__ import annotations

from pathlib import Path

from accord import dist
from accord.models import apply_lora, build_model
from accord.outputs import save_final_model
from accord.recipe import Recipe


def export_final(engine, recipe: Recipe, task, tokenizer, out_dir: Path, info: dist.DistInfo) -> Path:
    """Collective under sharded strategies (the full weights are gathered to rank 0)."""
    final = out_dir / "final"
    state = engine.full_model_state()
    if info.is_main:
        module = engine.module
        if recipe.lora is not None:
            save_final_model(module, tokenizer, out_dir / "adapter", state_dict=state)
            if recipe.lora.merge_on_export:
                module, state = _merged(module, state, recipe, task, tokenizer), None
        save_final_model(module, tokenizer, final, state_dict=state)
    dist.barrier()
    return final


def _merged(module, state, recipe: Recipe, task, tokenizer):
    """The adapters merged into the weights. Training is over, so a whole module is merged
    in place; a sharded one (fsdp, zero3) is rebuilt on the CPU from the gathered state first."""
    if state is None:
        return module.merge_and_unload()
    plain = build_model(recipe.model, tokenizer, recipe.seed, task.model_kind, task.model_kwargs())
    plain = apply_lora(plain, recipe.lora, task.model_kind, recipe.seed)
    plain.load_state_dict(state)
    return plain.merge_and_unload()
