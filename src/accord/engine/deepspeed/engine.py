"""DeepSpeed ZeRO stages 1-3 (optionally with CPU offload) behind accord's Engine.

The DeepSpeed config is derived from the recipe (deepspeed_config.py). accord keeps its own
learning-rate schedule and its own loss normalisation, and checkpoints in accord's format
(deepspeed_state.py), so a run written under ZeRO resumes under any strategy on any number
of processes.

How accord's calls map onto DeepSpeed's:
- sync_context(last) sets DeepSpeed's gradient-accumulation boundary explicitly, so its
  reductions happen exactly on accord's last micro-step (DeepSpeed's documented pattern
  for calling engine.step() once after all micro-steps);
- backward(loss_sum, N) back-propagates loss_sum × world / N without DeepSpeed's 1/GA
  scaling; DeepSpeed averages over ranks, so the gradient is sum(losses) / N, as under DDP;
- step() is one optimizer step: DeepSpeed clips (gradient_clipping), drops non-finite
  updates itself, and accord's scheduler advances once.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from accord import registry
from accord.compat.deepspeed import import_deepspeed, reuse_fp32_partitions
from accord.compat.torch import extension_build_lock
from accord.distributed import group as dist
from accord.distributed.batch_plan import BatchPlan
from accord.distributed.group import DistInfo
from accord.engine import INSTALL_DEEPSPEED, deepspeed_available
from accord.engine.base import Engine
from accord.engine.deepspeed.config import deepspeed_config
from accord.engine.long_rows import apply_memory_levers
from accord.engine.optim import build_scheduler, param_groups
from accord.engine.precision import autocast
from accord.engine.spec import EngineSpec
from accord.engine.state import PendingWrite
from accord.engine.wrapping import ensure_process_group
from accord.errors import UserInputError


def build(
    spec: EngineSpec, model: nn.Module, info: DistInfo, device: torch.device, plan: BatchPlan, total_steps: int
) -> DeepSpeedEngine:
    if not deepspeed_available():
        raise UserInputError(
            f"engine.strategy={spec.engine.strategy} needs DeepSpeed, which is not installed: {INSTALL_DEEPSPEED}"
        )
    return DeepSpeedEngine(model, spec, info, device, plan, total_steps)


# The C++ op DeepSpeed builds (once, cached) when its process group starts on the CPU.
_CPU_OP = "deepspeed_shm_comm"


def _say_if_the_op_build_is_locked() -> None:
    """DeepSpeed's op build waits, silently and for ever, while another build's lock file
    exists; a build that was killed leaves it behind. Said before the wait, so a run that
    stops here names the file."""
    try:
        lock = extension_build_lock(_CPU_OP)
    except Exception:  # noqa: BLE001 - only a hint: torch without the helper just waits as before
        return
    if lock.exists():
        print(
            f"accord: warning: waiting for {lock}: another process is building DeepSpeed's CPU op; if none is "
            "(a build that was killed leaves this file behind), delete the file and the run goes on",
            file=sys.stderr,
            flush=True,
        )


class DeepSpeedEngine(Engine):
    def __init__(
        self,
        model: nn.Module,
        spec: EngineSpec,
        info: DistInfo,
        device: torch.device,
        plan: BatchPlan,
        total_steps: int,
    ):
        # Imported here, not above: without DeepSpeed this module must still load, for build's message.
        deepspeed = import_deepspeed()

        from accord.engine.deepspeed.state import DeepSpeedState

        _quiet_deepspeed(info)
        ensure_process_group(device)
        # DeepSpeed insists on the launcher's LOCAL_RANK, absent when accord runs as one process.
        os.environ.setdefault("LOCAL_RANK", str(info.local_rank))
        # accord's dist.init created the process group: DeepSpeed adopts it. (On the CPU it
        # also loads a shared-memory op used only for inference, printing a line per rank.)
        if device.type == "cpu" and info.local_rank == 0:
            _say_if_the_op_build_is_locked()
        with contextlib.redirect_stdout(io.StringIO()):
            deepspeed.init_distributed(
                dist_backend="nccl" if device.type == "cuda" else "gloo", dist_init_required=False
            )
        self.device = device
        self.world_size = info.world_size
        self.precision = spec.engine.precision
        self.stage = registry.strategy(spec.engine.strategy).zero_stage
        apply_memory_levers(model, spec.engine, spec.max_length, device)
        config = deepspeed_config(spec, plan, device, model, info.world_size)
        self._config = config
        self._materialize(model, config)
        groups = param_groups(model, spec.optim)
        names = {id(p): name for name, p in model.named_parameters()}
        group_names = [[names[id(p)] for p in g["params"]] for g in groups]
        with reuse_fp32_partitions(self.stage == 3 and self.precision != "fp16"):
            self._wrapped, _, _, _ = deepspeed.initialize(
                model=model, model_parameters=groups, config=config, dist_init_required=False
            )
        self.module = self._wrapped.module
        self._state = DeepSpeedState(self._wrapped, self.stage, self.precision, device, group_names)
        self.state_optimizer = self._state.base
        # accord's schedule, on the optimizer that DeepSpeed steps: the same learning rates as DDP.
        self.scheduler = build_scheduler(self._state.base, spec.optim, total_steps)

    def _materialize(self, model: nn.Module, config: dict) -> None:
        """Values for a meta-device model (accord.models.weights). ZeRO-1/2 hold every parameter
        on every rank; ZeRO-3 partitions each parameter as soon as it exists, the way
        DeepSpeed's own partitioned construction (zero.Init) does: rank 0 provides the values
        (per-name init or the safetensors tensor), the partitioning scatters them, and no rank
        holds more than one module's tensors beyond its partitions."""
        from accord.models.weights import materialize, materialize_each_parameter

        if self.stage < 3:
            materialize(model, "cpu")
            return
        deepspeed = import_deepspeed()

        first: list[nn.Parameter] = []

        def convert(param: nn.Parameter) -> None:
            if first:  # as DeepSpeed converts a module's late parameters itself
                first[0].convert_to_zero_parameters(param_list=[param])
                return
            holder = nn.Module()
            holder.register_parameter("p", param)
            deepspeed.zero.Init(module=holder, config_dict_or_path=config)
            first.append(param)

        materialize_each_parameter(model, convert, provider=dist.is_main())

    def prepare_frozen(self, model: nn.Module) -> nn.Module:
        """Under ZeRO-3 a frozen model (DPO's reference) is partitioned like the policy and
        run by a DeepSpeed engine without an optimizer (its forward gathers collectively)."""
        if self.stage < 3:
            return super().prepare_frozen(model)
        deepspeed = import_deepspeed()

        model.requires_grad_(False)
        self._materialize(model, self._config)
        config = {k: v for k, v in self._config.items() if k not in ("optimizer", "scheduler", "gradient_clipping")}
        engine, _, _, _ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
        self._frozen = [*getattr(self, "_frozen", []), engine]
        return engine.module.eval()

    # ------------------------------------------------------------------ the loop

    @property
    def lockstep(self) -> bool:
        return self.stage == 3  # ZeRO-3 gathers parameters collectively in every forward

    def sync_context(self, last_micro_step: bool) -> contextlib.AbstractContextManager:
        self._wrapped.set_gradient_accumulation_boundary(last_micro_step)
        return contextlib.nullcontext()

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.precision, self.device)

    def backward(self, loss_sum: torch.Tensor, global_targets: int) -> None:
        self._wrapped.backward(loss_sum * (self.world_size / global_targets), scale_wrt_gas=False)

    def step(self, skip_nonfinite: bool = False) -> tuple[torch.Tensor, bool]:
        # DeepSpeed computes the norm of the whole gradient, clips, and drops a non-finite
        # update (fp16 overflow or a NaN/inf gradient) itself, identically on every rank,
        # whatever `skip_nonfinite` says: the trainer stops the run on it under on_nonfinite=stop.
        self._wrapped.set_gradient_accumulation_boundary(True)
        self._wrapped.step()
        norm = self._wrapped.get_global_grad_norm()
        grad_norm = torch.as_tensor(float("nan") if norm is None else norm, dtype=torch.float32).to(self.device)
        # An fp16 overflow is the loss scaler's to handle (as torch's GradScaler does for the
        # other strategies): not a dropped update that counts towards train.max_skipped_steps.
        applied = self._wrapped.was_step_applied() or self.handles_overflow
        self.scheduler.step()
        return grad_norm, applied

    @property
    def handles_overflow(self) -> bool:
        return self.precision == "fp16"

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    # ------------------------------------------------------------------ state

    def full_tensors(self, writer: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
        return self._state.full_tensors(writer)

    def save_state(self, folder: Path, writer: bool, asynchronous: bool = False) -> PendingWrite | None:
        return self._state.save(folder, writer, self.scheduler, asynchronous)

    def model_state_bytes(self) -> dict[str, int]:
        held = super().model_state_bytes()
        held["master"] += self._state.unlisted_master_bytes()
        return held

    def load_state(self, folder: Path) -> None:
        self._state.load(folder, self.scheduler)

    def compile(self) -> None:
        # DeepSpeed compiles its own wrapped module in place (its engine keeps the hooks).
        self._wrapped.compile()
        self._compiled = self._wrapped

    def close(self) -> None:
        for engine in getattr(self, "_frozen", []):
            engine.destroy()
        self._wrapped.destroy()


def _quiet_deepspeed(info: DistInfo) -> None:
    """accord prints its own progress; DeepSpeed's info lines (and other ranks' warnings) are
    noise, and so are the FutureWarnings of the torch collectives it calls by their old names."""
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING if info.is_main else logging.ERROR)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
