"""The pipeline-parallel engine: each rank holds its stages of the model; a step's
micro-batches run through all stages in one call of torch's schedule (train_batch).

Ranks r*P … r*P+P-1 (P = engine.pipeline_parallel) are one pipeline and train on one
data-parallel group's rows; the mesh is ("dp", "pp") (under ddp ("dp", "dp_shard", "pp") with
a dp_shard of 1, FSDP2's hybrid mode replicating over "dp" as DDP does). Over "dp" each stage
module is FSDP2-wrapped (per decoder layer, then the stage), which torch's PipelineStage
drives: gradients are reduced once, after the step's last micro-batch.

The loss is accord's: each micro-batch's summed token loss divided by the targets of the whole
global batch (and multiplied by the data-parallel groups, whose gradient FSDP2 averages); the
schedule's own scaling by the number of micro-batches is off (scale_grads=False), so the
gradients are those of one process over the same global batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.tensor import DTensor

from accord.distributed.group import DistInfo
from accord.engine.base import unique_entries
from accord.engine.long_rows import apply_memory_levers
from accord.engine.pipeline.schedule import SINGLE, rank_stages, schedule_class
from accord.engine.pipeline.stages import StageModule, check_pipeline, keep_stages, owner_stage, stage_layers
from accord.engine.precision import DTYPES
from accord.engine.spec import EngineSpec
from accord.engine.torch_update import TorchUpdateEngine
from accord.engine.wrapping import ensure_process_group
from accord.errors import UserInputError
from accord.models.weights import materialize


class PipelineEngine(TorchUpdateEngine):
    pipelined = True

    def __init__(self, model: nn.Module, spec: EngineSpec, info: DistInfo, device: torch.device, total_steps: int):
        from torch.distributed.device_mesh import init_device_mesh

        engine = spec.engine
        problems = check_pipeline(engine, model.config, pipelines=info.world_size // engine.pipeline_parallel)
        if problems:
            raise UserInputError(problems[0])
        ensure_process_group(device)
        self.pp, self.schedule_name = engine.pipeline_parallel, engine.pipeline_schedule
        self.dp = info.world_size // self.pp
        self.pp_rank, self.dp_rank = info.rank % self.pp, info.rank // self.pp
        self.num_stages = self.pp * engine.stages_per_rank
        self.stage_ids = rank_stages(self.schedule_name, self.pp_rank, self.pp, engine.stages_per_rank)
        decoder = model.get_decoder()
        num_layers = len(decoder.layers)
        self.hidden_size, self.vocab_size = decoder.config.hidden_size, model.config.get_text_config().vocab_size
        # The whole model's entries (names, shapes) and the pipeline rank holding each, for the export.
        placement = {
            s: r for r in range(self.pp) for s in rank_stages(self.schedule_name, r, self.pp, engine.stages_per_rank)
        }
        self._entries = [
            (name, placement[owner_stage(name, num_layers, self.num_stages)], t.shape, t.dtype)
            for name, t in unique_entries(model)
        ]
        apply_memory_levers(model, engine, spec.max_length, device)
        keep_stages(model, self.stage_ids, self.num_stages)
        sharded = engine.strategy == "fsdp"
        # FSDP2 computes in bf16/fp16 itself where it wraps the stages (over 2+ pipelines).
        compute = DTYPES.get(engine.precision) if sharded and self.dp > 1 and engine.precision != "no" else None
        # What flows between stages: the residual stream's dtype (fp32 master weights, autocast or
        # not, unless FSDP2 computes in bf16/fp16).
        self.send_dtype = compute or torch.float32
        names, shape = (
            (("dp", "pp"), (self.dp, self.pp)) if sharded else (("dp", "dp_shard", "pp"), (self.dp, 1, self.pp))
        )
        self.mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        self.pp_group = self.mesh["pp"].get_group()
        split = stage_layers(num_layers, self.num_stages)
        self.stage_modules = [
            StageModule(model, split[s], s == 0, s == self.num_stages - 1, self.send_dtype) for s in self.stage_ids
        ]
        if self.dp > 1:
            self._data_parallel(self.mesh["dp"] if sharded else self.mesh["dp", "dp_shard"], compute)
        materialize(model, device)
        model.to(device)
        super().__init__(model, model, spec, info, device, total_steps)
        self.world_size = self.dp  # the gradient average FSDP2 takes is over the data-parallel groups
        self._schedule: tuple[tuple, object] | None = None
        self._loss_scale = 1.0
        self._loss_of: Callable | None = None

    def _data_parallel(self, mesh, compute: torch.dtype | None) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = (
            MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute else MixedPrecisionPolicy()
        )
        for module in self.stage_modules:
            for layer in module.layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(module, mesh=mesh, mp_policy=policy)

    @property
    def holds_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def sync_context(self, last_micro_step: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the schedule reduces gradients after its last micro-batch

    def backward(self, loss_sum: torch.Tensor, global_targets: int) -> None:
        raise NotImplementedError("under engine.pipeline_parallel the schedule runs backward (train_batch)")

    # ------------------------------------------------------------------ one step

    def train_batch(
        self,
        batch: dict[str, torch.Tensor],
        micro_batches: int,
        global_targets: int,
        loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Forward and backward of this pipeline's rows of the global batch (`batch`, every rank of
        the pipeline holding the same, its first dimension `micro_batches` micro-batches of rows)
        through the stages. `loss_of(logits, labels)`: a micro-batch's summed loss. Returns this
        rank's share of the step's summed loss (this pipeline's, on the ranks of its last stage; 0
        elsewhere), as the loop logs it."""
        rows, width = batch["input_ids"].shape
        schedule = self._schedule_for(rows // micro_batches, width, micro_batches)
        self._loss_scale, self._loss_of = self.world_size / global_targets, loss_of
        extra = {k: batch[k] for k in ("attention_mask", "position_ids") if k in batch}
        args = (batch["input_ids"],) if 0 in self.stage_ids else ()
        losses: list[torch.Tensor] = []
        with self.autocast():
            schedule.step(
                *args,
                target=batch["labels"] if self.holds_last else None,
                losses=losses if self.holds_last else None,
                return_outputs=False,
                **extra,
            )
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach() for loss in losses]).sum() / self._loss_scale

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._loss_of(logits, labels) * self._loss_scale

    def _schedule_for(self, rows: int, width: int, micro_batches: int):
        """The stages and schedule for micro-batches of `rows` × `width` tokens. A stage's
        receive buffers have fixed shapes, so a new width gets new (cheap: no parameters are
        copied) stage objects; each step's rows are padded to one width per pipeline."""
        from torch.distributed.pipelining import PipelineStage

        key = (rows, width, micro_batches)
        if self._schedule is not None and self._schedule[0] == key:
            return self._schedule[1]
        hidden = (rows, width, self.hidden_size)
        stages = []
        for s, module in zip(self.stage_ids, self.stage_modules):
            if s == 0:
                given = torch.empty(rows, width, dtype=torch.long, device="meta")
            else:
                given = torch.empty(hidden, dtype=self.send_dtype, device="meta", requires_grad=True)
            last = s == self.num_stages - 1
            # The gradient sent back has the dtype of what was sent forward.
            out = torch.empty(
                (rows, width, self.vocab_size) if last else hidden,
                dtype=self.send_dtype,
                device="meta",
                requires_grad=True,
            )
            stages.append(
                PipelineStage(
                    module, s, self.num_stages, self.device, input_args=given, output_args=out, group=self.pp_group
                )
            )
        cls = schedule_class(self.schedule_name)
        schedule = cls(
            stages[0] if self.schedule_name in SINGLE else stages,
            n_microbatches=micro_batches,
            loss_fn=self._loss,
            scale_grads=False,
        )
        self._schedule = (key, schedule)
        return schedule

    def _whole_norm(self, local: torch.Tensor) -> torch.Tensor:
        # Each rank's norm covers its stages; the whole gradient's norm sums their squares.
        squared = local.detach().float().pow(2)
        torch_dist.all_reduce(squared, group=self.pp_group)
        return squared.sqrt()

    # ------------------------------------------------------------------ export

    def full_tensors(self, writer: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Collective: every entry of the whole model, in its state-dict order. The ranks holding
        an entry's stage gather it over "dp" (FSDP2 shards), the first pipeline's holder sends it
        to global rank 0."""
        local = dict(unique_entries(self.module))
        for name, owner, shape, dtype in self._entries:
            tensor = None
            if owner == self.pp_rank:
                tensor = local[name]
                if isinstance(tensor, DTensor):
                    tensor = tensor.full_tensor()
                tensor = tensor.detach()
            if self.dp_rank == 0 and owner != 0:
                if self.pp_rank == owner:
                    torch_dist.send(tensor.contiguous(), dst=owner_global(0, 0, self.pp))
                elif self.pp_rank == 0:
                    tensor = torch.empty(shape, dtype=dtype, device=self.device)
                    torch_dist.recv(tensor, src=owner_global(0, owner, self.pp))
            yield name, (tensor.cpu() if writer and tensor is not None else None)


def owner_global(dp_rank: int, pp_rank: int, pp: int) -> int:
    """The global rank of pipeline rank `pp_rank` in data-parallel group `dp_rank` (pp innermost)."""
    return dp_rank * pp + pp_rank


def build(spec: EngineSpec, model: nn.Module, info: DistInfo, device: torch.device, total_steps: int) -> PipelineEngine:
    return PipelineEngine(model, spec, info, device, total_steps)
