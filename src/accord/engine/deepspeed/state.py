"""DeepSpeed ZeRO state in accord's checkpoint layout (engine.state: sharded, keyed by
parameter name), so a run written under ZeRO resumes under any strategy on any number of
processes (DeepSpeed's own checkpoints are laid out by stage and world size).

DeepSpeed's public helpers (deepspeed.utils.safe_get/set_full_*) read and write one
parameter's whole weights and optimizer state, and under ZeRO-3 safe_set_local_* this rank's
partition of them (with the ZeRO-3 parameter's own `ds_tensor`, `ds_status`, `partition` and
`all_gather`, which DeepSpeed's partitioned parameters carry). What they leave out (the base
optimizer, the flat fp32 partitions it keys its state by, relinking ZeRO-1/2's views of that
state, the fp16 loss scale) goes through accord.compat.deepspeed, which checks every internal
this run needs when the engine is built.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_optimizer_state,
)
from torch import nn

from accord.compat import deepspeed as ds_compat
from accord.distributed import group as dist
from accord.engine.base import unique_entries
from accord.engine.state import (
    MODEL,
    OPTIM,
    WRITE_BUFFER_BYTES,
    PendingWrite,
    SaveEntry,
    load_schedule,
    read_flat_ranges,
    read_whole,
    save_parts,
    save_schedule,
    stored_keys,
    write_in_parts,
    write_sharded,
)

ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")
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
        self._engine = engine
        self._zero = engine.optimizer  # DeepSpeed's ZeRO optimizer, around the base optimizer
        ds_compat.check_internals(engine, stage, precision)
        self.base: torch.optim.Optimizer = ds_compat.base_optimizer(engine)  # holds the AdamW state

    # ------------------------------------------------------------------ save

    def full_tensors(self, writer: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Collective: each state-dict entry as a whole fp32 CPU tensor (the fp32 master weights
        where DeepSpeed keeps them), one at a time; only `writer` keeps them."""
        self._release_gathered()
        params = {id(p) for p in self.module.parameters()}
        for name, tensor in unique_entries(self.module):
            if id(tensor) in params:
                value = self._full_param(tensor)
                yield name, (value.detach().float().cpu() if writer else None)
                del value
            else:  # a buffer: never partitioned
                yield name, (tensor.detach().cpu().clone() if writer else None)

    def _full_param(self, param: nn.Parameter) -> torch.Tensor:
        """Collective: the whole of one parameter (every rank gets it)."""
        value = safe_get_full_fp32_param(param) if param.requires_grad else None
        if value is None:  # no fp32 master (frozen)
            if self.stage == 3:
                with deepspeed.zero.GatheredParameters([param]):
                    return param.data.detach().clone()
            return param.data
        return value

    def save(
        self, folder: Path, writer: bool, scheduler: torch.optim.lr_scheduler.LRScheduler, asynchronous: bool = False
    ) -> PendingWrite | None:
        """Collective: the layout every strategy writes (engine.state), from DeepSpeed's
        partitions. DeepSpeed has no per-name shards, so each tensor is gathered whole, one at
        a time, and kept only by the rank that writes it (round-robin by name), and the ranks
        write in parallel. Synchronous: in parts of at most WRITE_BUFFER_BYTES per rank (or
        one tensor), each written before the next is gathered. Asynchronous: training goes on
        while the files are written, with every tensor gathered by then, so a rank holds its
        whole share (12 bytes per parameter / world: weights and AdamW moments) until written
        (once: DCP is told not to copy it again, where this torch can be)."""
        self._release_gathered()
        step = self._step_count()  # None before the first applied update (e.g. an fp16 overflow)
        if step is not None:
            self._link_optimizer_state()
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        tensors = self.module.state_dict(keep_vars=True)
        entries = self._entries(tensors, with_optimizer=step is not None)
        parts = save_parts(entries, world, None if asynchronous else WRITE_BUFFER_BYTES)
        states = (self._gather(tensors, part, rank, step) for part in parts)
        pending = (
            write_sharded(next(states), folder, asynchronous=True, owned=True)
            if asynchronous
            else write_in_parts(states, folder)
        )
        if writer:
            extra = {LOSS_SCALE_KEY: ds_compat.loss_scale(self._zero)} if self.precision == "fp16" else {}
            save_schedule(folder, scheduler, None, **extra)
        return pending

    def _release_gathered(self) -> None:
        """ZeRO-3: partition again what a forward left gathered or still being gathered (an
        evaluation's forward prefetches parameters no backward releases), which
        GatheredParameters refuses to gather (frozen parameters, e.g. under LoRA, go
        through it). The next forward gathers what it needs."""
        if self.stage == 3:
            self._engine.empty_partition_cache()

    def _entries(self, tensors: dict[str, torch.Tensor], with_optimizer: bool) -> list[SaveEntry]:
        """What a checkpoint holds, in the order every rank gathers it: each state-dict entry,
        then each trainable parameter's AdamW moments."""
        entries = []
        for name, tensor in tensors.items():
            if isinstance(tensor, nn.Parameter):  # saved as fp32, whatever the working copy's dtype
                entries.append(SaveEntry(MODEL, name, 4 * _numel(tensor)))
            else:
                entries.append(SaveEntry(MODEL, name, tensor.numel() * tensor.element_size()))
        if with_optimizer:
            params = dict(self.module.named_parameters())
            entries += [
                SaveEntry(OPTIM, name, 4 * len(ADAM_STATE_KEYS) * _numel(params[name]))
                for names in self.group_names
                for name in names
            ]
        return entries

    def _gather(
        self, tensors: dict[str, torch.Tensor], part: list[tuple[int, SaveEntry]], rank: int, step: float | None
    ) -> dict:
        """Collective: one part's tensors (of `tensors`, the state dict) gathered whole in
        turn; this rank keeps those it owns."""
        params = dict(self.module.named_parameters())
        model: dict[str, torch.Tensor] = {}
        optim: dict[str, dict[str, torch.Tensor]] = {}
        for owner, entry in part:
            keep = owner == rank
            if entry.kind == MODEL:
                tensor = tensors[entry.name]
                if not isinstance(tensor, nn.Parameter):  # a buffer: never partitioned
                    if keep:
                        model[entry.name] = tensor.detach().cpu().clone()
                    continue
                value = self._full_param(tensor)  # collective
                if keep:
                    model[entry.name] = value.detach().float().cpu().clone()
                del value
                continue
            state = {"step": torch.tensor(step, dtype=torch.float32)}
            for key in ADAM_STATE_KEYS:
                value = safe_get_full_optimizer_state(params[entry.name], key)  # collective
                if keep:
                    state[key] = value.detach().float().cpu().clone()
                del value
            if keep:
                optim[entry.name] = state
        return {MODEL: model, OPTIM: optim}

    def _step_count(self) -> float | None:
        for state in self.base.state.values():
            if "step" in state:
                return float(state["step"])
        return None

    # ------------------------------------------------------------------ load

    def load(self, folder: Path, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        """Collective: restore what any strategy's save_state wrote, on any world size, a
        bounded batch at a time. Under ZeRO-3 each rank reads only the rows around its
        partition of each tensor (_load_partitions); ZeRO-1/2 ranks hold every parameter and
        read whole tensors, each keeping its part of the flat master and AdamW state."""
        stored = stored_keys(folder)
        params = dict(self.module.named_parameters())
        missing = sorted(name for name in params if f"{MODEL}.{name}" not in stored)
        if missing:
            raise RuntimeError(f"{folder}: the checkpoint has no weights for {', '.join(missing[:5])}")
        buffers = [f"{MODEL}.{name}" for name, _ in self.module.named_buffers() if f"{MODEL}.{name}" in stored]
        weights = buffers if self.stage == 3 else [f"{MODEL}.{name}" for name in params] + buffers
        for batch in read_whole(folder, weights, stored):
            self._load_weights({key[len(MODEL) + 1 :]: value for key, value in batch.items()})
            batch.clear()  # before the next batch is read
        if self.stage == 3:
            self._load_partitions(folder, stored, {f"{MODEL}.{name}": (param, None) for name, param in params.items()})
            self._gather_again()
        trainable = [name for names in self.group_names for name in names]
        optim_keys = [
            f"{OPTIM}.{name}.{key}"
            for name in trainable
            for key in ADAM_STATE_KEYS
            if f"{OPTIM}.{name}.{key}" in stored
        ]
        if optim_keys:
            (step,) = next(read_whole(folder, [f"{OPTIM}.{trainable[0]}.step"], stored)).values()
            self._create_optimizer_state(float(step))
        if optim_keys and self.stage == 3:
            self._load_partitions(
                folder,
                stored,
                {key: (params[key[len(OPTIM) + 1 :].rsplit(".", 1)[0]], key.rsplit(".", 1)[1]) for key in optim_keys},
            )
        elif optim_keys:
            for batch in read_whole(folder, optim_keys, stored):
                for key in list(batch):
                    name, state_key = key[len(OPTIM) + 1 :].rsplit(".", 1)
                    safe_set_full_optimizer_state(params[name], batch.pop(key).to(self.device), state_key)
        extra = load_schedule(folder, scheduler)
        if self.precision == "fp16" and LOSS_SCALE_KEY in extra:
            ds_compat.set_loss_scale(self._zero, extra[LOSS_SCALE_KEY])

    def _load_weights(self, values: dict[str, torch.Tensor]) -> None:
        """Whole tensors by name (a batch of them): buffers, and under ZeRO-1/2 the fp32
        master weights (each rank keeps its part of the flat groups) and the working copy."""
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        with torch.no_grad():
            for name, value in values.items():
                if name in buffers and name not in params:
                    buffers[name].copy_(value.to(buffers[name].device, buffers[name].dtype))
                    continue
                param = params[name]  # ZeRO-1/2 (ZeRO-3's parameters: _load_partitions)
                if param.requires_grad:
                    safe_set_full_fp32_param(param, value.to(self.device))
                param.data.copy_(value.to(param.device, param.dtype))

    def _load_partitions(self, folder: Path, stored: dict, keys: dict[str, tuple[nn.Parameter, str | None]]) -> None:
        """ZeRO-3: each rank reads only the elements of its partition of each tensor (by `keys`:
        the parameter, and the AdamW state key or None for the weights), a bounded batch at a
        time, into the fp32 master partition or that state's, and the weights also into the
        working partition the forward gathers. No collective."""
        rank = torch.distributed.get_rank()
        ranges = {}
        for key, (param, _) in keys.items():
            size = param.ds_tensor.ds_numel  # one rank's partition (the last one padded)
            start = min(rank * size, _numel(param))
            ranges[key] = (start, min(start + size, _numel(param)))
        for batch in read_flat_ranges(folder, {key: span for key, span in ranges.items() if span[1] > span[0]}, stored):
            for key in list(batch):  # emptied as it goes: nothing of it is held when the next batch is read
                self._set_partition(*keys[key], batch.pop(key))
        for key, (start, stop) in ranges.items():
            if stop == start:  # a parameter too small for every rank to hold some: padding only
                self._set_partition(*keys[key], torch.zeros(0))

    def _gather_again(self) -> None:
        """Collective, after the weights' partitions were loaded: the parameters DeepSpeed holds
        gathered (its persistent ones, small) still hold the old weights: dropped, and
        gathered from the new partitions."""
        with torch.no_grad():
            gathered = [p for p in self.module.parameters() if p.ds_status == ZeroParamStatus.AVAILABLE]
            if gathered:
                gathered[0].partition(param_list=gathered, has_been_updated=False)
                gathered[0].all_gather(gathered)

    def _set_partition(self, param: nn.Parameter, state_key: str | None, value: torch.Tensor) -> None:
        """This rank's elements of one tensor (`value`, as many as it owns) into its partition,
        padded as DeepSpeed pads the last one."""
        piece = torch.zeros(param.ds_tensor.ds_numel, dtype=torch.float32)
        piece[: value.numel()] = value
        if state_key is not None:
            safe_set_local_optimizer_state(param, piece.to(self.device), state_key)
            return
        if param.requires_grad:
            safe_set_local_fp32_param(param, piece.to(self.device))
        with torch.no_grad():
            param.ds_tensor.copy_(piece.to(param.ds_tensor.device, param.ds_tensor.dtype))

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
            flats = ds_compat.fp32_partitions(self._zero)
        else:
            flats = [p for group in self.base.param_groups for p in group["params"]]
        if not flats:
            raise RuntimeError(
                f"DeepSpeed {deepspeed.__version__}: {type(self._zero).__name__} holds no fp32 partitions "
                "to load optimizer state into"
            )
        return flats

    def unlisted_master_bytes(self) -> int:
        """Bytes of ZeRO-3's fp32 master partitions, which its base optimizer's groups list only
        while it steps (0 under ZeRO-1/2, whose groups always list them). A partition that is
        the parameters' own flat partition is not a copy and is not counted."""
        if self.stage != 3:
            return 0
        own = {
            flat.untyped_storage().data_ptr() for flat in ds_compat.working_partitions(self._zero) if flat is not None
        }
        return sum(
            flat.numel() * flat.element_size()
            for flat in self._flat_params()
            if flat.untyped_storage().data_ptr() not in own
        )

    def _link_optimizer_state(self) -> None:
        """ZeRO-1/2 read and write the optimizer state through per-parameter views of the
        flat state tensors, linked once after the first update — while only the first
        parameter group has state (each group steps in turn), so the other groups' views
        stay empty. Linking again once every group has state fixes that. (ZeRO-3 has no
        such views: its helpers index the flat state directly.)"""
        if self.stage == 3:
            return
        ds_compat.relink_optimizer_state(self._zero)


def _warn_if_untested() -> None:
    version = ds_compat.untested_version()
    if version is not None:
        dist.print0(
            f"accord: warning: DeepSpeed {version} is not one accord's DeepSpeed checkpointing was written for "
            f"({ds_compat.written_for()}); it checks the internals it needs and stops if one is missing"
        )


def _numel(param: nn.Parameter) -> int:
    """Elements of the whole parameter (ZeRO-3 leaves an empty tensor in a partitioned one)."""
    return int(getattr(param, "ds_numel", param.numel()))
