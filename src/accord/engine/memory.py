"""What a strategy holds per rank, for `accord plan`: each registered strategy names its
MemoryModel (accord.registry.Strategy.memory): DDP's and FSDP2's here, DeepSpeed ZeRO's in
accord.engine.deepspeed.memory. They sit beside the engines, not inside their modules, which
import the optimizer and transformers' schedules (seconds) that planning never needs.

A memory model answers two questions about rank 0 (which holds the largest share):
- state: bytes of parameters, gradients, optimizer state and master copy, given the model's
  parameter shapes (meta tensors), the world, the precision and what it offloads;
- phases: each phase's peak (build, train, checkpoint, export, resume), bytes above an empty
  process's, given that state and the activations (Footprint gathers what every model reads).

accord trains fp32 weights (autocast computes in bf16/fp16); AdamW keeps two fp32 moments per
element and one step count per tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from accord.recipe.schema import Recipe

WEIGHT = 4  # bytes of an fp32 weight or gradient


def adam_bytes(elements: int, tensors: int) -> int:
    """AdamW's state for `elements` trained values in `tensors` tensors: exp_avg, exp_avg_sq, step."""
    return 2 * 4 * elements + 4 * tensors * (elements > 0)


@dataclass
class Footprint:
    """What every phase model reads: the model, the run, the state and activations per rank."""

    strategy: str  # the registered name being planned
    model: nn.Module
    world: int
    state: dict[str, float]
    activations: float
    recipe: Recipe
    cpu: bool  # CPU processes: host memory is the device's

    @cached_property
    def compute(self) -> int:
        """Bytes of a value in the compute dtype."""
        return 2 if self.recipe.engine.precision in ("bf16", "fp16") else 4

    @cached_property
    def whole(self) -> int:
        """Bytes of the whole model in fp32."""
        return 4 * sum(p.numel() for p in self.model.parameters())

    @cached_property
    def largest(self) -> int:
        """Bytes of the largest parameter in fp32."""
        return 4 * max((p.numel() for p in self.model.parameters()), default=0)

    @cached_property
    def module_buffer(self) -> int:
        """Bytes of the largest module's own parameters in fp32 (one initialised or loaded at a time)."""
        modules = self.model.modules()
        return 4 * max((sum(p.numel() for p in m.parameters(recurse=False)) for m in modules), default=0)

    @property
    def params(self) -> float:
        return self.state["params"]

    @property
    def grads(self) -> float:
        return self.state["grads"]

    @property
    def optimizer(self) -> float:
        return self.state["optimizer"]

    @property
    def master(self) -> float:
        return self.state["master"]

    @property
    def update(self) -> float:
        """AdamW on the CPU updates one tensor at a time (one tensor's temporary); on a GPU its
        fused kernel needs none."""
        return self.largest if self.cpu else 0.0

    @cached_property
    def layer_unit(self) -> int:
        """Elements of the largest sharding unit (a decoder layer, engine.fsdp_layer_class)."""
        return max((sum(p.numel() for p in layer.parameters()) for layer in self._layers), default=0)

    @cached_property
    def gathered(self) -> float:
        """What a strategy that shards parameters gathers while training: the root's
        parameters (kept from forward to backward) and two layers' (the one running and the
        one prefetched) in the compute dtype, plus the running layer's whole gradient before
        its reduce-scatter."""
        in_layers = {id(p) for layer in self._layers for p in layer.parameters()}
        root = sum(p.numel() for p in self.model.parameters() if id(p) not in in_layers)
        return self.compute * (root + 2 * self.layer_unit) + 4 * self.layer_unit

    @cached_property
    def _layers(self) -> list:
        from accord.engine.wrapping import layer_modules

        return layer_modules(self.model, self.recipe.engine.fsdp_layer_class)

    def peaks(
        self, build: float, train: float, resume: float, at_rest: float | None = None, staged: float | None = None
    ) -> dict[str, float]:
        """The five phases from a strategy's build, train and resume peaks. `at_rest`: what
        stays between steps (default: parameters, optimizer state and master copy; gradients
        are freed after each step); `staged`: what a checkpoint holds in host memory beside
        it (default: under checkpoint.async on the CPU, a copy of the state at rest).
        checkpoint: the state at rest and one tensor being serialised; export: the state at
        rest and the tensor being gathered, and on the CPU the whole copy being written (the
        writing rank writes each whole tensor to its safetensors shard as it arrives)."""
        at_rest = self.params + self.optimizer + self.master if at_rest is None else at_rest
        if staged is None:
            staged = at_rest if self.recipe.checkpoint.async_ and self.cpu else 0.0
        checkpoint = max(train, at_rest + self.largest + staged)
        export = at_rest + self.largest + (self.largest if self.cpu else 0.0)
        return {"build": build, "train": train, "checkpoint": checkpoint, "export": export, "resume": resume}


class MemoryModel(Protocol):
    def state(self, model: nn.Module, world: int, precision: str, offload: str) -> dict[str, float]:
        """Bytes of model state on rank 0 under `offload` (one of the strategy's offloads)."""
        ...

    def phases(self, footprint: Footprint) -> dict[str, float]:
        """Each phase's peak on rank 0 (Footprint.peaks)."""
        ...


class DDPMemory:
    """Every rank holds everything: fp32 parameters, their gradients and AdamW's state.

    Built: DDP allocates its gradient buckets (gradients are views into them) when it wraps
    the model. Resumed: the optimizer state is created by a zero step (its gradients already
    in the buckets) and the checkpoint read into it one tensor at a time."""

    def state(self, model: nn.Module, world: int, precision: str, offload: str) -> dict[str, float]:
        params = list(model.parameters())
        trainable = [p for p in params if p.requires_grad]
        trained = sum(p.numel() for p in trainable)
        return {
            "params": WEIGHT * sum(p.numel() for p in params),
            "grads": WEIGHT * trained,
            "optimizer": adam_bytes(trained, len(trainable)),
            "master": 0.0,
        }

    def phases(self, footprint: Footprint) -> dict[str, float]:
        f = footprint
        buckets = f.grads if f.world > 1 else 0.0  # one process: no DDP
        build = f.params + buckets
        train = f.params + f.grads + f.optimizer + max(f.activations, f.update)
        resume = build + f.optimizer + (f.grads - buckets) + f.largest  # measured: the zero step adds nothing more
        return f.peaks(build, train, resume)


class FSDPMemory:
    """Parameters, gradients and AdamW's state sharded per tensor: rank 0 holds the first
    chunk of dim 0 of each (torch.chunk, as FSDP2 shards), and gathers layers while training.

    Built: on the meta device, each module initialised or loaded whole, one at a time
    (accord.models.weights). Resumed: the optimizer state created by a zero step (with
    gradients) and the checkpoint read into it one tensor at a time."""

    def state(self, model: nn.Module, world: int, precision: str, offload: str) -> dict[str, float]:
        params = list(model.parameters())
        trainable = [p for p in params if p.requires_grad]
        shard = sum(_chunk0(p, world) for p in trainable)
        return {
            "params": WEIGHT * sum(_chunk0(p, world) for p in params),
            "grads": WEIGHT * shard,
            "optimizer": adam_bytes(shard, len(trainable)),
            "master": 0.0,
        }

    def phases(self, footprint: Footprint) -> dict[str, float]:
        f = footprint
        build = f.params + f.module_buffer
        train = f.params + f.grads + f.optimizer + f.master + max(f.activations + f.gathered, f.update)
        resume = build + f.optimizer + f.master + f.grads + f.largest
        return f.peaks(build, train, resume)


def _chunk0(p: torch.Tensor, world: int) -> int:
    """Elements of rank 0's FSDP2 shard: torch.chunk along dim 0."""
    if p.dim() == 0:
        return p.numel()
    rows = math.ceil(p.shape[0] / world)
    return min(rows, p.shape[0]) * (p.numel() // max(p.shape[0], 1))


DDP = DDPMemory()
FSDP = FSDPMemory()


def tensor_parallel_local(model: nn.Module, tensor_parallel: int) -> nn.Module:
    """`model` (on the meta device) with each linear layer that engine.tensor_parallel splits
    cut to one rank's part, in place: column-wise layers keep 1/N of their output rows (and
    bias), row-wise ones 1/N of their input columns (their bias stays whole). The strategies'
    memory models then count a TP rank's state over the data-parallel world."""
    import fnmatch

    import torch
    from torch import nn

    from accord.engine.tensor_parallel import plan_words

    words = plan_words(model.config) or {}
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "base_model", model)
    for name, module in base.named_modules():
        word = next((w for pattern, w in words.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if word not in ("colwise", "rowwise") or not isinstance(module, nn.Linear):
            continue
        out_features, in_features = module.weight.shape
        shape = (
            (out_features // tensor_parallel, in_features)
            if word == "colwise"
            else (
                out_features,
                in_features // tensor_parallel,
            )
        )
        trained = module.weight.requires_grad
        module.weight = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=trained)
        if module.bias is not None and word == "colwise":
            module.bias = nn.Parameter(torch.empty(shape[0], device="meta"), requires_grad=trained)
    return model


def expert_parallel_local(model: nn.Module, expert_parallel: int) -> nn.Module:
    """`model` (on the meta device) with each MoE layer's fused expert parameters cut to one
    rank's experts under engine.expert_parallel (1/N of their rows), in place."""
    import torch
    from torch import nn

    from accord.models.moe import config_experts

    experts = config_experts(model.config)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dim() == 3 and p.shape[0] == experts:
                local = torch.empty((experts // expert_parallel, *p.shape[1:]), device="meta", dtype=p.dtype)
                setattr(module, name, nn.Parameter(local, requires_grad=p.requires_grad))
    return model
