"""The recipe's `engine:` section: processes, devices, strategy, precision and the memory and
parallelism levers. Kept out of recipe.py for its size (each lever validates against the others)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from accord import registry
from accord.recipe.section import Section

PROCESS_GROUP_TIMEOUT_S = 600
# engine.pipeline_schedule values that run one stage per rank (the others interleave several).
SINGLE_STAGE_SCHEDULES = ("1f1b", "gpipe")


class RayConfig(Section):
    """engine.launcher=ray: the Ray cluster and what each Ray Train worker reserves there."""

    address: str | None = Field(
        None,
        description="The Ray cluster to join (ray.init's address: auto, HOST:6379 or ray://HOST:10001); default: "
        "the RAY_ADDRESS environment variable, else a local Ray instance started for the run and stopped after it.",
    )
    nodes: int = Field(
        1,
        ge=1,
        description="The run has nodes x engine.processes workers; Ray places them (placement_strategy). The data, "
        "the model and output.dir must be at the same path on every node Ray uses (a shared file system).",
    )
    cpus_per_worker: float = Field(1.0, gt=0, description="Logical CPUs Ray reserves for each worker.")
    gpus_per_worker: float | None = Field(
        None,
        ge=0,
        description="GPUs Ray reserves for each worker; default: 1 when engine.device is cuda, or auto on a Ray "
        "cluster with GPUs, else 0 (gloo on the CPU).",
    )
    resources_per_worker: dict[str, float] = Field(
        {},
        description="Other Ray resources each worker reserves, e.g. {memory: 4.0e9} or a custom resource "
        "{trainium: 1} (CPU and GPU: cpus_per_worker and gpus_per_worker).",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = Field(
        None,
        description="How Ray places the workers' bundles over nodes; default: PACK on one node, SPREAD over several.",
    )

    @field_validator("resources_per_worker")
    @classmethod
    def _not_cpu_or_gpu(cls, value: dict[str, float]) -> dict[str, float]:
        for key, amount in value.items():
            if key in ("CPU", "GPU"):
                raise ValueError(
                    f"engine.ray.resources_per_worker.{key}: set engine.ray.{key.lower()}s_per_worker instead"
                )
            if amount < 0:
                raise ValueError(f"engine.ray.resources_per_worker.{key}={amount:g} must be at least 0")
        return value


class EngineConfig(Section):
    """Where and how the model runs: processes, devices, strategy, precision."""

    # A name registered in accord.registry.STRATEGIES (built-in or added with accord.register_strategy).
    strategy: str = Field(
        "ddp",
        description="Distributed strategy: ddp (every rank holds everything), fsdp (PyTorch FSDP2: parameters, "
        "gradients and optimizer state sharded per decoder layer), zero1 / zero2 / zero3 (DeepSpeed ZeRO: optimizer "
        "state / + gradients / + parameters sharded).",
    )
    precision: Literal["no", "bf16", "fp16"] = Field(
        "no", description="Mixed precision: no (fp32), bf16, or fp16 with a gradient scaler."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: every visible GPU, else the CPU.")
    processes: int = Field(2, gt=0, description="Worker processes on CPU (on GPU: one per device).")
    devices: list[int] | None = Field(None, description="GPU indices to use, e.g. [0, 1] (default: all visible).")
    launcher: Literal["accord", "ray"] = Field(
        "accord",
        description="Who starts the workers: accord (torch's elastic agent on this node, or the outer launcher "
        "that started `accord train`: torchrun, accelerate, srun) or ray (Ray Train workers on a Ray cluster, "
        "engine.ray; docs/ray.md).",
    )
    ray: RayConfig = RayConfig()
    max_restarts: int = Field(
        0,
        ge=0,
        description="When a worker dies or hangs, restart the whole local group up to this many times; it resumes "
        "from the latest checkpoint.",
    )
    # Well under the process-group timeout (PROCESS_GROUP_TIMEOUT_S): past that, torch ends the
    # run itself without saying which rank was stuck or where.
    hang_timeout_s: float | None = Field(
        300.0,
        description="Hang watchdog, under every launcher (accord's, srun, torchrun, accelerate launch, deepspeed, "
        "Ray): when no rank made progress for this many seconds, name the stuck rank(s), dump every rank's stacks "
        "into output.dir/hang-<time>/ and stop the workers (restarted under engine.max_restarts where accord "
        "launched them). Longer than the slowest single phase (a step, one eval batch, one checkpoint write); "
        "null: off.",
    )
    deepspeed_config: str | None = Field(
        None,
        description="A DeepSpeed JSON you already have: its stage, offload, batch sizes, accumulation, clipping and "
        "precision must agree with the recipe (checked before starting; they fill in what the recipe leaves open).",
    )
    compile: bool = Field(
        False, description="torch.compile the model's training forward (first steps are slower while it compiles)."
    )
    peak_tflops: float | None = Field(
        None,
        gt=0,
        description="Peak dense bf16 TFLOP/s of one device, for MFU (default: looked up from the GPU's name).",
    )
    offload: Literal["none", "optimizer", "optimizer+params"] = Field(
        "none",
        description="zero strategies: keep the optimizer state (and with zero3 also the parameters) in CPU memory "
        "(DeepSpeed ZeRO-Offload). On a CPU-only run this changes nothing but the code path.",
    )
    release_host_memory: bool = Field(
        False,
        description="Return host memory to the OS as soon as a tensor of 1 MiB or more is freed (glibc's malloc with a "
        "fixed mmap threshold, as MALLOC_MMAP_THRESHOLD_=1048576 does). On CPU runs under fsdp or zero3 a rank's peak "
        "RSS "
        "then follows its live tensors (measured: about half) for about a third more CPU time (see "
        "docs/memory-and-plan.md); a GPU's memory is not affected.",
    )
    activation_checkpointing: bool | Literal["offload"] = Field(
        False,
        description="Recompute each layer's activations in backward instead of storing them (less memory, ~1/3 more "
        "compute); "
        "offload: also keep what checkpointing saves (each layer's input) in host memory until backward (pinned on "
        "GPU; "
        "on a CPU run the same as true).",
    )
    tiled_mlp: bool | int = Field(
        False,
        description="Run each decoder layer's MLP over this many sequence tiles, each recomputed in backward, so its "
        "intermediate activations exist for one tile at a time (rows of 10k+ tokens); true: tiles of about hidden_size "
        "tokens of data.max_length.",
    )
    fsdp_layer_class: str | None = Field(
        None,
        description="fsdp: class name of the modules sharded as one unit each, e.g. LlamaDecoderLayer "
        "(default: the model's _no_split_modules, else the blocks of its layer list).",
    )
    sequence_parallel: int = Field(
        1,
        ge=1,
        description="Ulysses sequence parallelism: each row's tokens are split over groups of this many ranks, "
        "attention "
        "exchanges sequence shards for head shards (all-to-all); the world is data-parallel x this. Must divide the "
        "number of processes and the model's attention heads (sft and pretrain).",
    )
    tensor_parallel: int = Field(
        1,
        ge=1,
        description="Tensor parallelism (torch's parallelize_module): each decoder layer's attention heads and MLP "
        "features are split over groups of this many consecutive ranks (keep a group inside a node), which train on "
        "the same rows; the world is data-parallel x this, with ddp or fsdp over the data-parallel groups. Must "
        "divide the processes, the attention and key/value heads and the intermediate size (sft, pretrain, classify, "
        "reward; no LoRA).",
    )
    expert_parallel: int = Field(
        1,
        ge=1,
        description="Expert parallelism (transformers' expert-parallel layer): each mixture-of-experts layer's "
        "experts are split over groups of this many consecutive ranks, and each routed token goes to its expert's rank "
        "and back by all-to-all; the ranks of a group train on different rows, and the rest of the model is "
        "data-parallel over every rank (ddp or fsdp). Must divide the processes and the experts per layer (sft and "
        "pretrain; no LoRA, tensor, pipeline or sequence parallelism yet; docs/moe.md).",
    )
    pipeline_parallel: int = Field(
        1,
        ge=1,
        description="Pipeline parallelism (torch.distributed.pipelining): the decoder layers are split into stages "
        "over groups of this many consecutive ranks (embeddings on the first stage, final norm and head on the last), "
        "and each global batch's micro-batches flow through them as engine.pipeline_schedule orders; the world is "
        "data-parallel x this, with ddp or fsdp over the data-parallel groups. The decoder layers must divide into "
        "the stages (sft and pretrain; no LoRA, tied embeddings, tensor or sequence parallelism yet; "
        "docs/pipeline.md).",
    )
    pipeline_schedule: Literal["1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "zbv"] = Field(
        "1f1b",
        description="engine.pipeline_parallel: the order of micro-batches through the stages, torch's schedules: "
        "1f1b (Schedule1F1B), gpipe (all forwards, then all backwards), interleaved-1f1b "
        "(ScheduleInterleaved1F1B, engine.pipeline_stages_per_rank stages on each rank), zero-bubble "
        "(ScheduleInterleavedZeroBubble: backward split into input and weight gradients) or zbv "
        "(ScheduleZBVZeroBubble: two stages per rank in a V).",
    )
    pipeline_stages_per_rank: int | None = Field(
        None,
        ge=1,
        description="engine.pipeline_parallel: stages (virtual stages) each rank holds; the model has "
        "pipeline_parallel x this stages. Default: 1 for 1f1b and gpipe, 2 for interleaved-1f1b, zero-bubble and zbv "
        "(zbv needs exactly 2, 1f1b and gpipe exactly 1).",
    )
    zero1_implementation: Literal["auto", "deepspeed", "torch"] = Field(
        "auto",
        description="zero1: deepspeed (DeepSpeed ZeRO-1) or torch (torch's ZeroRedundancyOptimizer over DDP); "
        "auto: DeepSpeed when it is installed, else torch.",
    )

    @field_validator("strategy")
    @classmethod
    def _registered_strategy(cls, value: str) -> str:
        if value not in registry.STRATEGIES:
            raise ValueError(registry.unknown_name("engine.strategy", "strategy", value, registry.STRATEGIES))
        return value

    @field_validator("hang_timeout_s")
    @classmethod
    def _hang_timeout_below_group_timeout(cls, value: float | None) -> float | None:
        if value is not None and not 1 <= value < PROCESS_GROUP_TIMEOUT_S:
            raise ValueError(
                f"engine.hang_timeout_s={value:g} must be at least 1 and below {PROCESS_GROUP_TIMEOUT_S} s (the "
                "process-group "
                "timeout, after which torch stops the run without naming the stuck rank); null turns the watchdog off"
            )
        return value

    # Before pydantic's union: one line instead of one per member of the union.
    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _checkpointing_word(cls, value: Any) -> Any:
        if not isinstance(value, bool) and value != "offload":
            raise ValueError(f"engine.activation_checkpointing={value!r} must be true, false or offload")
        return value

    @field_validator("tiled_mlp", mode="before")
    @classmethod
    def _tiles_positive(cls, value: Any) -> Any:
        if not isinstance(value, (bool, int)) or (not isinstance(value, bool) and value < 1):
            raise ValueError(f"engine.tiled_mlp={value!r} must be true, false or a number of tiles of at least 1")
        return value

    @field_validator("precision", mode="before")
    @classmethod
    def _yaml_no_is_false(cls, value: Any) -> Any:
        # YAML 1.1 reads an unquoted `no` as false; it is what the user meant.
        return "no" if value is False else value

    @model_validator(mode="after")
    def _ray_options(self) -> EngineConfig:
        if self.launcher != "ray":
            # Values, not the keys given: a resolved recipe (the workers' JSON) names every key.
            changed = [name for name in RayConfig.model_fields if getattr(self.ray, name) != getattr(RayConfig(), name)]
            if changed:
                raise ValueError(
                    f"engine.ray.{changed[0]} applies to Ray workers: add engine.launcher=ray, or leave it out"
                )
            return self
        if self.devices is not None:
            raise ValueError(
                "engine.devices: under engine.launcher=ray Ray gives each worker its GPUs; "
                "set engine.ray.gpus_per_worker instead"
            )
        if self.device == "cpu" and self.ray.gpus_per_worker:
            raise ValueError(
                f"engine.ray.gpus_per_worker={self.ray.gpus_per_worker:g} with engine.device=cpu: the workers would "
                "hold GPUs they never use; set engine.device=cuda (or auto), or leave gpus_per_worker out"
            )
        if self.device == "cuda" and self.ray.gpus_per_worker == 0:
            raise ValueError(
                "engine.ray.gpus_per_worker=0 with engine.device=cuda: each worker needs a GPU; "
                "set engine.device=cpu, or gpus_per_worker to 1"
            )
        return self

    @property
    def stages_per_rank(self) -> int:
        """engine.pipeline_stages_per_rank as the schedule runs it (its default filled in)."""
        if self.pipeline_stages_per_rank is not None:
            return self.pipeline_stages_per_rank
        return 1 if self.pipeline_schedule in SINGLE_STAGE_SCHEDULES else 2

    @model_validator(mode="after")
    def _pipeline_options(self) -> EngineConfig:
        n, schedule = self.pipeline_parallel, self.pipeline_schedule
        key = f"engine.pipeline_parallel={n}"
        if n == 1:
            # Values, not the keys given: a resolved recipe (the workers' JSON) names every key.
            changed = [
                k
                for k in ("pipeline_schedule", "pipeline_stages_per_rank")
                if getattr(self, k) != EngineConfig.model_fields[k].default
            ]
            if changed:
                raise ValueError(
                    f"engine.{changed[0]} applies to pipeline parallelism: set engine.pipeline_parallel "
                    "to 2 or more, or leave it out"
                )
            return self
        v = self.pipeline_stages_per_rank
        if v is not None and schedule in SINGLE_STAGE_SCHEDULES and v != 1:
            raise ValueError(
                f"engine.pipeline_stages_per_rank={v} with engine.pipeline_schedule={schedule}, which runs one stage "
                "per rank; use pipeline_schedule=interleaved-1f1b (or zero-bubble), or stages_per_rank 1"
            )
        if v is not None and schedule == "zbv" and v != 2:
            raise ValueError(
                f"engine.pipeline_stages_per_rank={v} with engine.pipeline_schedule=zbv, which places exactly 2 "
                "stages per rank (a V); set it to 2 or leave it out"
            )
        # The other model-parallel levers: each would need its own stage layout (not built yet).
        others = [
            f"engine.{k}={getattr(self, k)}" for k in ("tensor_parallel", "sequence_parallel") if getattr(self, k) > 1
        ]
        if others:
            raise ValueError(f"{key} with {others[0]} is not supported yet; use one of them")
        return self

    @model_validator(mode="after")
    def _strategy_options(self) -> EngineConfig:
        spec = registry.strategy(self.strategy)
        if self.offload != "none" and "optimizer" not in spec.offloads:
            raise ValueError(
                f"engine.offload={self.offload} needs a DeepSpeed strategy "
                f"(engine.strategy={_offloading('optimizer')}); {self.strategy} keeps everything on the device"
            )
        if self.offload == "optimizer+params" and self.offload not in spec.offloads:
            raise ValueError(
                f"engine.offload=optimizer+params needs engine.strategy={_offloading(self.offload)} "
                f"(only ZeRO-3 shards the parameters); with {self.strategy} use engine.offload=optimizer"
            )
        if spec.torch_fallback and self.zero1_implementation == "torch" and self.offload != "none":
            raise ValueError(
                "engine.offload needs DeepSpeed: torch's ZeroRedundancyOptimizer (engine.zero1_implementation=torch) "
                "cannot offload"
            )
        return self


def _offloading(level: str) -> str:
    """The registered strategies that can offload `level`, as a sentence lists them."""
    names = [name for name, spec in registry.STRATEGIES.items() if level in spec.offloads]
    return " or ".join(filter(None, [", ".join(names[:-1]), names[-1]]))
