"""DeepSpeed ZeRO stages 1-3 (optionally with CPU offload) behind accord's Engine.

The DeepSpeed config is derived from the recipe (batch, clipping, precision, AdamW settings):
nothing is left to "auto". accord keeps its own learning-rate schedule and its own loss
normalisation, and checkpoints in accord's format (full tensors keyed by parameter name),
so a run written under ZeRO resumes under any strategy on any number of processes.

How accord's calls map onto DeepSpeed's:
- sync_context(last) sets DeepSpeed's gradient-accumulation boundary explicitly, so its
  reductions happen exactly on accord's last micro-step (DeepSpeed's documented pattern
  for calling engine.step() once after all micro-steps);
- backward(loss_sum, N) back-propagates loss_sum × world / N without DeepSpeed's 1/GA
  scaling; DeepSpeed averages over ranks, so the gradient is sum(losses) / N, as under DDP;
- step() is one optimizer step: DeepSpeed clips (gradient_clipping), skips non-finite
  updates itself, and accord's scheduler advances once.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accord import dist
from accord.batching import BatchPlan
from accord.dist import DistInfo
from accord.engine.base import Engine
from accord.engine.optim import build_scheduler, param_groups
from accord.engine.precision import autocast
from accord.engine.state import load_schedule, read_state_files, save_schedule, write_state_files
from accord.engine.wrapping import enable_activation_checkpointing, ensure_process_group, hidden_size
from accord.recipe import Recipe

ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def deepspeed_config(recipe: Recipe, plan: BatchPlan, device: torch.device, model: nn.Module | None = None) -> dict[str, Any]:
    """The whole DeepSpeed config, from the recipe (no "auto" values)."""
    engine, optim = recipe.engine, recipe.optim
    stage = int(engine.strategy.removeprefix("zero"))
    cuda = device.type == "cuda"
    offload_optimizer = engine.offload in ("optimizer", "optimizer+params")
    adamw: dict[str, Any] = {"lr": optim.lr, "betas": list(optim.betas), "eps": optim.eps, "weight_decay": optim.weight_decay}
    if not (cuda and offload_optimizer):
        # torch's AdamW (the DDP path's optimizer, fused on GPU like it); only an optimizer
        # offloaded from a GPU uses DeepSpeed's compiled CPU Adam, which is much faster there.
        adamw["torch_adam"] = True
        if cuda:
            adamw["fused"] = True
    zero: dict[str, Any] = {
        "stage": stage,
        "contiguous_gradients": True,
        "overlap_comm": cuda,  # overlapping needs streams; on the CPU it only adds bookkeeping
        "reduce_scatter": True,
    }
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    if engine.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    if stage == 3:
        width = hidden_size(model) if model is not None else None
        # Parameters smaller than this stay whole on every rank (norms, biases): gathering
        # them costs more than they weigh. 10 × hidden size, as transformers' integration derives it.
        zero["stage3_param_persistence_threshold"] = 10 * width if width else 100_000
        zero["stage3_gather_16bit_weights_on_model_save"] = False  # accord gathers fp32 weights itself
    config: dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": float(optim.max_grad_norm) if optim.max_grad_norm is not None else 0.0,
        "optimizer": {"type": "AdamW", "params": adamw},
        "zero_optimization": zero,
        "bf16": {"enabled": engine.precision == "bf16"},
        "fp16": {
            "enabled": engine.precision == "fp16",
            # Dynamic loss scaling with torch.amp.GradScaler's defaults.
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 2000,
            "hysteresis": 1,
            "min_loss_scale": 1,
        },
        "steps_per_print": 2**31 - 1,  # accord reports progress itself
        "wall_clock_breakdown": False,
    }
    if engine.precision != "no":
        config["communication_data_type"] = "fp32"  # reduce gradients in fp32, as under DDP/FSDP
    assert "auto" not in repr(config), config
    return config


class DeepSpeedEngine(Engine):
    def __init__(self, model: nn.Module, recipe: Recipe, info: DistInfo, device: torch.device, plan: BatchPlan, total_steps: int):
        if device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        _quiet_deepspeed(info)
        # DeepSpeed calls collectives that torch 2.13 renamed: one FutureWarning per call otherwise.
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        ensure_process_group(device)
        # DeepSpeed insists on the launcher's LOCAL_RANK, absent when accord runs as one process.
        os.environ.setdefault("LOCAL_RANK", str(info.local_rank))
        # accord's dist.init created the process group: DeepSpeed adopts it. (On the CPU it
        # also loads a shared-memory op used only for inference, printing a line per rank.)
        with contextlib.redirect_stdout(io.StringIO()):
            deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", dist_init_required=False)
        self.device = device
        self.world_size = info.world_size
        self.rank = info.rank
        self.precision = recipe.engine.precision
        self.stage = int(recipe.engine.strategy.removeprefix("zero"))
        if recipe.engine.activation_checkpointing:
            enable_activation_checkpointing(model)
        self.config = deepspeed_config(recipe, plan, device, model)
        groups = param_groups(model, recipe.optim)
        names = {id(p): name for name, p in model.named_parameters()}
        self._group_names = [[names[id(p)] for p in g["params"]] for g in groups]
        self.model, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=groups, config=self.config, dist_init_required=False
        )
        self._module = self.model.module
        self._base_optimizer: torch.optim.Optimizer = self.model.basic_optimizer
        # accord's schedule, on the optimizer that DeepSpeed steps: the same learning rates as DDP.
        self.scheduler = build_scheduler(self._base_optimizer, recipe.optim, total_steps)

    # ------------------------------------------------------------------ the loop

    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def lockstep(self) -> bool:
        return self.stage == 3  # ZeRO-3 gathers parameters collectively in every forward

    def sync_context(self, last_micro_step: bool) -> contextlib.AbstractContextManager:
        self.model.set_gradient_accumulation_boundary(last_micro_step)
        return contextlib.nullcontext()

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.precision, self.device)

    def backward(self, loss_sum: torch.Tensor, global_targets: int) -> None:
        self.model.backward(loss_sum * (self.world_size / global_targets), scale_wrt_gas=False)

    def step(self, skip_nonfinite: bool = False) -> tuple[torch.Tensor, bool]:
        # DeepSpeed computes the norm of the whole gradient, clips, and skips a non-finite
        # update (fp16 overflow or a NaN/inf gradient) itself, identically on every rank.
        self.model.set_gradient_accumulation_boundary(True)
        self.model.step()
        norm = self.model.get_global_grad_norm()
        grad_norm = torch.as_tensor(float("nan") if norm is None else norm, dtype=torch.float32).to(self.device)
        # An fp16 overflow is the loss scaler's to handle (as torch's GradScaler does for the
        # other strategies): not a skipped update that counts towards train.max_skipped_steps.
        stepped = self.model.was_step_applied() or self.handles_overflow
        self.scheduler.step()
        return grad_norm, stepped

    @property
    def handles_overflow(self) -> bool:
        return self.precision == "fp16"

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    # ------------------------------------------------------------------ state

    def _full_model_state(self, writer: bool) -> dict[str, torch.Tensor]:
        """Collective: every entry of the model's state dict as a full fp32 CPU tensor
        (the fp32 master weights where DeepSpeed keeps them); only `writer` keeps them."""
        from deepspeed.utils import safe_get_full_fp32_param

        by_id: dict[int, torch.Tensor] = {}
        for _, param in self._module.named_parameters():
            value = safe_get_full_fp32_param(param) if param.requires_grad else None
            if value is None:
                value = self._gather(param)
            if writer:
                by_id[id(param)] = value.detach().float().cpu()
        state = {}
        for name, tensor in self._module.state_dict(keep_vars=True).items():
            if id(tensor) in by_id:
                state[name] = by_id[id(tensor)]
            elif writer:  # a buffer: never partitioned
                state[name] = tensor.detach().cpu().clone()
        return state

    def _gather(self, param: nn.Parameter) -> torch.Tensor:
        """The whole of a parameter that has no fp32 master (frozen)."""
        if self.stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([param]):
                return param.data.detach().clone()
        return param.data

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        state = self._full_model_state(writer=dist.is_main())
        return state if dist.is_main() else None

    def _optimizer_step_count(self) -> float | None:
        for state in self._base_optimizer.state.values():
            if "step" in state:
                return float(state["step"])
        return None

    def _flat_params(self) -> list[torch.Tensor]:
        """The flat fp32 partitions that the base optimizer updates (its state's keys)."""
        flats = [p for group in self._base_optimizer.param_groups for p in group["params"]]
        if not flats:  # ZeRO-3 hands them to the optimizer's groups only while it steps
            flats = list(getattr(self.optimizer, "fp32_partitioned_groups_flat", None) or [])
        if not flats:
            raise RuntimeError(f"cannot find the optimizer's parameters under {type(self.optimizer).__name__}")
        return flats

    def save_state(self, folder: Path, writer: bool) -> None:
        from deepspeed.utils import safe_get_full_optimizer_state

        model_state = self._full_model_state(writer)
        step = self._optimizer_step_count()  # None before the first applied update (e.g. an fp16 overflow)
        if step is not None:
            self._link_optimizer_state()
        state: dict[str, dict[str, torch.Tensor]] = {}
        params = dict(self._module.named_parameters())
        for names in self._group_names:
            for name in names:
                if step is None:
                    continue
                entry = {"step": torch.tensor(step, dtype=torch.float32)}
                for key in ADAM_STATE_KEYS:
                    value = safe_get_full_optimizer_state(params[name], key)  # collective
                    if writer:
                        entry[key] = value.detach().float().cpu()
                state[name] = entry
        if not writer:
            return
        groups = []
        for names, group in zip(self._group_names, self._base_optimizer.param_groups):
            groups.append({k: v for k, v in group.items() if k != "params"} | {"params": list(names)})
        write_state_files(model_state, {"state": state, "param_groups": groups}, folder)
        extra = {}
        if self.precision == "fp16":
            extra["deepspeed_loss_scale"] = float(self.optimizer.loss_scale)
        save_schedule(folder, self.scheduler, None, **extra)

    def load_state(self, folder: Path) -> None:
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        model_state, optim_state = read_state_files(folder)
        params = dict(self._module.named_parameters())
        missing = sorted(set(params) - set(model_state))
        if missing:
            raise RuntimeError(f"{folder}: the checkpoint has no weights for {', '.join(missing[:5])}")
        # The fp32 master weights (partitioned: each rank keeps its part) ...
        for name, param in params.items():
            if param.requires_grad:
                safe_set_full_fp32_param(param, model_state[name].to(self.device))
        # ... and the working copy the forward uses.
        with torch.no_grad():
            for name, param in params.items():
                value = model_state[name]
                if self.stage == 3:
                    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                        if self.rank == 0:
                            param.data.copy_(value.to(param.device, param.dtype))
                else:
                    param.data.copy_(value.to(param.device, param.dtype))
            for name, buffer in self._module.named_buffers():
                if name in model_state:
                    buffer.copy_(model_state[name].to(buffer.device, buffer.dtype))
        saved = optim_state.get("state", {})
        if saved:
            step = float(next(iter(saved.values()))["step"])
            self._create_optimizer_state(step)
            for name, param in params.items():
                if param.requires_grad and name in saved:
                    for key in ADAM_STATE_KEYS:
                        safe_set_full_optimizer_state(param, saved[name][key].to(self.device), key)
        self._restore_group_settings(optim_state.get("param_groups", []))
        extra = load_schedule(folder, self.scheduler)
        if "deepspeed_loss_scale" in extra and hasattr(getattr(self.optimizer, "loss_scaler", None), "cur_scale"):
            self.optimizer.loss_scaler.cur_scale = extra["deepspeed_loss_scale"]

    def _create_optimizer_state(self, step: float) -> None:
        """AdamW creates its state at the first update; a resumed run needs it before, to
        load into. Created here exactly as the optimizer would (zeros, the step count)."""
        base = self._base_optimizer
        torch_adam = isinstance(base, torch.optim.Adam | torch.optim.AdamW)
        settings = base.defaults  # accord's groups differ in weight decay only
        for flat in self._flat_params():
            state = base.state[flat]
            if not state:
                state["exp_avg"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
                if settings.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
            if torch_adam:
                on_device = settings.get("fused") or settings.get("capturable")
                state["step"] = torch.tensor(step, dtype=torch.float32, device=flat.device if on_device else "cpu")
            else:  # DeepSpeed's CPU Adam counts steps in a plain int
                state["step"] = int(step)
        self._link_optimizer_state()

    def _link_optimizer_state(self) -> None:
        """ZeRO-1/2 read and write the optimizer state through per-parameter views of the
        flat state tensors, linked once after the first update — while only the first
        parameter group has state (each group steps in turn), so the other groups' views
        stay empty. Linking again once every group has state fixes that."""
        link = getattr(self.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None and hasattr(self.optimizer, "_hp_optimizer_states_linked"):
            self.optimizer._hp_optimizer_states_linked = False
            link()

    def _restore_group_settings(self, saved_groups: list[dict]) -> None:
        """The learning rate each group had when the checkpoint was written (the scheduler
        sets it again from the next step on)."""
        by_first_name = {g["params"][0]: g for g in saved_groups if g.get("params")}
        for names, group in zip(self._group_names, self._base_optimizer.param_groups):
            saved = by_first_name.get(names[0])
            if saved is None:
                continue
            for key in ("lr", "initial_lr"):
                if key in saved:
                    group[key] = saved[key]

    def compile(self) -> None:
        # DeepSpeed compiles its own wrapped module in place (its engine keeps the hooks).
        self.model.compile()
        self.compiled = self.model

    def close(self) -> None:
        destroy = getattr(self.model, "destroy", None)
        if destroy is not None:
            destroy()


def _quiet_deepspeed(info: DistInfo) -> None:
    """accord prints its own progress; DeepSpeed's info lines (and other ranks' warnings) are noise."""
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING if info.is_main else logging.ERROR)
