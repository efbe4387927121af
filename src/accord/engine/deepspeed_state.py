"""DeepSpeed ZeRO state in accord's checkpoint format: full fp32 tensors keyed by parameter
name, so a run written under ZeRO resumes under any strategy on any number of processes
(DeepSpeed's own checkpoints are laid out by stage and world size).

DeepSpeed's public helpers (deepspeed.utils.safe_get/set_full_*) read and write one
parameter's whole weights and optimizer state. What they leave out goes through attributes
of DeepSpeed's internals: the base optimizer and the flat fp32 partitions it keys its state
by, creating that state before the first update, relinking ZeRO-1/2's per-parameter views of
it, and the fp16 loss scale. Those were read from DeepSpeed 0.16 to 0.19. Every one this run
needs is looked up when the engine is built: a missing one stops the run there, naming the
attribute and the installed version, instead of a checkpoint silently missing state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param, safe_set_full_optimizer_state
from packaging.version import Version
from torch import nn

from accord import dist
from accord.engine.state import load_schedule, read_state_files, save_schedule, write_state_files

ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")
# The DeepSpeed releases (major, minor) whose internals this module was written against.
WRITTEN_FOR = ((0, 16), (0, 19))
LOSS_SCALE_KEY = "deepspeed_loss_scale"  # in schedule.pt, for an fp16 run


class DeepSpeedState:
    def __init__(self, engine: Any, stage: int, precision: str, device: torch.device, group_names: list[list[str]]):
        """`engine` is what deepspeed.initialize returned; `group_names` names the parameters
        of each optimizer group, in order (the groups DeepSpeed flattened)."""
        _warn_if_untested()
        self.module: nn.Module = engine.module
        self.stage = stage
        self.precision = precision
        self.device = device
        self.group_names = group_names
        self._zero = engine.optimizer  # DeepSpeed's ZeRO optimizer, around the base optimizer
        self.base: torch.optim.Optimizer = _internal(engine, "basic_optimizer")  # holds the AdamW state
        for name in self._needed():
            _internal(self._zero, name)

    def _needed(self) -> list[str]:
        """The ZeRO optimizer's attributes this stage and precision use below."""
        needed = ["fp32_partitioned_groups_flat"] if self.stage == 3 else ["_hp_optimizer_states_linked", "_lazy_init_hp_params_optimizer_state"]
        if self.precision == "fp16":
            needed.append("loss_scale")
        return needed

    # ------------------------------------------------------------------ save

    def full_model_state(self, writer: bool) -> dict[str, torch.Tensor]:
        """Collective: every entry of the model's state dict as a full fp32 CPU tensor
        (the fp32 master weights where DeepSpeed keeps them); only `writer` keeps them."""
        by_id: dict[int, torch.Tensor] = {}
        for param in self.module.parameters():
            value = safe_get_full_fp32_param(param) if param.requires_grad else None
            if value is None:
                value = self._gather(param)
            if writer:
                by_id[id(param)] = value.detach().float().cpu()
        state = {}
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            if id(tensor) in by_id:
                state[name] = by_id[id(tensor)]
            elif writer:  # a buffer: never partitioned
                state[name] = tensor.detach().cpu().clone()
        return state

    def _gather(self, param: nn.Parameter) -> torch.Tensor:
        """The whole of a parameter that has no fp32 master (frozen)."""
        if self.stage == 3:
            with deepspeed.zero.GatheredParameters([param]):
                return param.data.detach().clone()
        return param.data

    def save(self, folder: Path, writer: bool, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        """Collective: accord's checkpoint files (model, optimizer, schedule) into `folder`."""
        model_state = self.full_model_state(writer)
        step = self._step_count()  # None before the first applied update (e.g. an fp16 overflow)
        optimizer_state = {} if step is None else self._full_optimizer_state(step, writer)
        if not writer:
            return
        groups = [
            {k: v for k, v in group.items() if k != "params"} | {"params": list(names)}
            for names, group in zip(self.group_names, self.base.param_groups)
        ]
        write_state_files(model_state, {"state": optimizer_state, "param_groups": groups}, folder)
        extra = {LOSS_SCALE_KEY: float(self._zero.loss_scale)} if self.precision == "fp16" else {}
        save_schedule(folder, scheduler, None, **extra)

    def _step_count(self) -> float | None:
        for state in self.base.state.values():
            if "step" in state:
                return float(state["step"])
        return None

    def _full_optimizer_state(self, step: float, writer: bool) -> dict[str, dict[str, torch.Tensor]]:
        """Collective: each trainable parameter's whole AdamW state (kept where `writer`)."""
        self._link_optimizer_state()
        params = dict(self.module.named_parameters())
        state = {}
        for name in (name for names in self.group_names for name in names):
            entry = {"step": torch.tensor(step, dtype=torch.float32)}
            for key in ADAM_STATE_KEYS:
                value = safe_get_full_optimizer_state(params[name], key)  # collective
                if writer:
                    entry[key] = value.detach().float().cpu()
            state[name] = entry
        return state

    # ------------------------------------------------------------------ load

    def load(self, folder: Path, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        """Collective: restore what any strategy's save_state wrote, on any world size."""
        model_state, optim_state = read_state_files(folder)
        self._load_weights(model_state, folder)
        saved = optim_state.get("state", {})
        if saved:
            self._create_optimizer_state(float(next(iter(saved.values()))["step"]))
            params = dict(self.module.named_parameters())
            for name, param in params.items():
                if param.requires_grad and name in saved:
                    for key in ADAM_STATE_KEYS:
                        safe_set_full_optimizer_state(param, saved[name][key].to(self.device), key)
        self._restore_group_settings(optim_state.get("param_groups", []))
        extra = load_schedule(folder, scheduler)
        if self.precision == "fp16" and LOSS_SCALE_KEY in extra:
            self._zero.loss_scale = extra[LOSS_SCALE_KEY]

    def _load_weights(self, model_state: dict[str, torch.Tensor], folder: Path) -> None:
        params = dict(self.module.named_parameters())
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
                        if dist.is_main():
                            param.data.copy_(value.to(param.device, param.dtype))
                else:
                    param.data.copy_(value.to(param.device, param.dtype))
            for name, buffer in self.module.named_buffers():
                if name in model_state:
                    buffer.copy_(model_state[name].to(buffer.device, buffer.dtype))

    def _create_optimizer_state(self, step: float) -> None:
        """AdamW creates its state at the first update; a resumed run needs it before, to
        load into. Created here exactly as the optimizer would (zeros, the step count)."""
        torch_adam = isinstance(self.base, torch.optim.Adam | torch.optim.AdamW)
        settings = self.base.defaults  # accord's groups differ in weight decay only
        for flat in self._flat_params():
            state = self.base.state[flat]
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

    def _flat_params(self) -> list[torch.Tensor]:
        """The flat fp32 partitions that the base optimizer updates (its state's keys)."""
        if self.stage == 3:  # ZeRO-3 hands them to the base optimizer's groups only while it steps
            flats = list(self._zero.fp32_partitioned_groups_flat)
        else:
            flats = [p for group in self.base.param_groups for p in group["params"]]
        if not flats:
            raise RuntimeError(
                f"DeepSpeed {deepspeed.__version__}: {type(self._zero).__name__} holds no fp32 partitions to load optimizer state into"
            )
        return flats

    def _link_optimizer_state(self) -> None:
        """ZeRO-1/2 read and write the optimizer state through per-parameter views of the
        flat state tensors, linked once after the first update — while only the first
        parameter group has state (each group steps in turn), so the other groups' views
        stay empty. Linking again once every group has state fixes that. (ZeRO-3 has no
        such views: its helpers index the flat state directly.)"""
        if self.stage == 3:
            return
        self._zero._hp_optimizer_states_linked = False
        self._zero._lazy_init_hp_params_optimizer_state()

    def _restore_group_settings(self, saved_groups: list[dict]) -> None:
        """The learning rate each group had when the checkpoint was written (the scheduler
        sets it again from the next step on)."""
        by_first_name = {g["params"][0]: g for g in saved_groups if g.get("params")}
        for names, group in zip(self.group_names, self.base.param_groups):
            saved = by_first_name.get(names[0])
            if saved is None:
                continue
            for key in ("lr", "initial_lr"):
                if key in saved:
                    group[key] = saved[key]


def _internal(obj: Any, name: str) -> Any:
    """An attribute of DeepSpeed's internals. Missing means a DeepSpeed this module was not
    written for: stop, saying which attribute and which version."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise RuntimeError(
            f"DeepSpeed {deepspeed.__version__}: {type(obj).__name__} has no attribute {name!r}, which accord's DeepSpeed "
            f"checkpointing needs (written for DeepSpeed {_written_for()}); install such a DeepSpeed or use engine.strategy=fsdp"
        ) from None


def _warn_if_untested() -> None:
    installed = Version(deepspeed.__version__).release[:2]
    if not WRITTEN_FOR[0] <= installed <= WRITTEN_FOR[1]:
        dist.print0(
            f"accord: warning: DeepSpeed {deepspeed.__version__} is not one accord's DeepSpeed checkpointing was written for "
            f"({_written_for()}); it checks the internals it needs and stops if one is missing"
        )


def _written_for() -> str:
    (low_major, low_minor), (high_major, high_minor) = WRITTEN_FOR
    return f"{low_major}.{low_minor} to {high_major}.{high_minor}.x"
