"""DeepSpeed internals accord uses (engine.deepspeed).

DeepSpeed's public helpers (deepspeed.utils.safe_get/set_full_*, safe_set_local_*) read and
write one parameter's weights and optimizer state; the ZeRO-3 parameter's own `ds_tensor`,
`ds_status`, `partition` and `all_gather` are what DeepSpeed's partitioned parameters carry.
What those leave out goes through the functions here: the base optimizer and the flat fp32
partitions it keys its state by, relinking ZeRO-1/2's per-parameter views of that state, the
fp16 loss scale, and, while the engine is built, a ZeRO-3 method made to compare devices
properly (reuse_fp32_partitions).

check_internals looks up every attribute a run needs when the engine is built: a missing one
stops the run there (IncompatibleLibrary), naming the attribute and the installed version,
instead of a checkpoint silently missing state. import_deepspeed is how accord imports DeepSpeed
(without the mlflow import its autotuner makes).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from accord.compat import incompatible

# The DeepSpeed releases (major, minor) whose internals this module was written against
# (0.19.8 installed when last checked).
WRITTEN_FOR = ((0, 16), (0, 19))


def written_for() -> str:
    (low_major, low_minor), (high_major, high_minor) = WRITTEN_FOR
    return f"{low_major}.{low_minor} to {high_major}.{high_minor}.x"


def import_deepspeed() -> ModuleType:
    """`import deepspeed`, without letting it import mlflow.

    DeepSpeed's autotuner (which accord never runs) imports mlflow whenever it is installed, on
    `import deepspeed`: most of that import's time, in every worker. mlflow is hidden
    for that import only (an absent module to DeepSpeed's try/except), so the mlflow tracker
    still imports it afterwards; where mlflow is imported already, nothing is hidden.
    """
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # import mlflow raises ImportError
    try:
        import deepspeed
    finally:
        if hide and sys.modules.get("mlflow", False) is None:
            del sys.modules["mlflow"]
    return deepspeed


def untested_version() -> str | None:
    """The installed DeepSpeed's version where it is outside WRITTEN_FOR, else None."""
    from packaging.version import Version

    deepspeed = import_deepspeed()

    installed = Version(deepspeed.__version__).release[:2]
    return None if WRITTEN_FOR[0] <= installed <= WRITTEN_FOR[1] else deepspeed.__version__


def _internal(
    obj: Any, name: str, needed_by: str = "accord's DeepSpeed checkpointing", remedy: str = "use engine.strategy=fsdp"
) -> Any:
    """An attribute of DeepSpeed's internals, or the one-line error naming it and the version."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise incompatible(
            "DeepSpeed",
            import_deepspeed().__version__,
            f"{type(obj).__name__} has no attribute {name!r}",
            needed_by,
            written_for(),
            remedy=remedy,
        ) from None


def _needed(stage: int, precision: str) -> list[str]:
    """The ZeRO optimizer's attributes that the functions below use at this stage and precision."""
    needed = (
        ["fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat"]
        if stage == 3
        else ["_hp_optimizer_states_linked", "_lazy_init_hp_params_optimizer_state"]
    )
    if precision == "fp16":
        needed.append("loss_scale")
    return needed


def check_internals(engine: Any, stage: int, precision: str) -> None:
    """Every internal of `engine` (what deepspeed.initialize returned) that a run at this
    stage and precision uses: a missing one raises IncompatibleLibrary now."""
    _internal(engine, "basic_optimizer")
    for name in _needed(stage, precision):
        _internal(engine.optimizer, name)


def base_optimizer(engine: Any) -> Any:
    """The torch optimizer inside DeepSpeed's ZeRO optimizer (it holds the AdamW state)."""
    return _internal(engine, "basic_optimizer")


def fp32_partitions(zero: Any) -> list:
    """ZeRO-3: the flat fp32 master partitions (its base optimizer's state keys), which its
    base optimizer's groups list only while it steps."""
    return list(_internal(zero, "fp32_partitioned_groups_flat"))


def working_partitions(zero: Any) -> list:
    """ZeRO-3: the flat partitions of the working parameters (None for one swapped out)."""
    return list(_internal(zero, "fp16_partitioned_groups_flat"))


def relink_optimizer_state(zero: Any) -> None:
    """ZeRO-1/2: link the per-parameter views of the flat optimizer state again (DeepSpeed
    links them once, at the first update)."""
    _internal(zero, "_hp_optimizer_states_linked")
    zero._hp_optimizer_states_linked = False
    _internal(zero, "_lazy_init_hp_params_optimizer_state")()


def loss_scale(zero: Any) -> float:
    """fp16: the dynamic loss scale of DeepSpeed's ZeRO optimizer."""
    return float(_internal(zero, "loss_scale"))


def set_loss_scale(zero: Any, value: float) -> None:
    _internal(zero, "loss_scale")
    zero.loss_scale = value


@contextlib.contextmanager
def reuse_fp32_partitions(fp32_parameters: bool) -> Iterator[None]:
    """While deepspeed.initialize runs: ZeRO-3 over fp32 parameters (accord's fp32 and bf16
    runs: bf16 is autocast) steps its optimizer on the parameters' own flat fp32 partitions,
    as DeepSpeed means to where they are already fp32 on its device, instead of an fp32 copy
    of them: 4 bytes per parameter of the partition fewer, on the GPU or the host alike.

    DeepSpeed's test for that (in DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions)
    compares the partition's `torch.device` with its device *name* (a string), which is never
    equal, so it always copies; here the method is swapped, for the duration, for one that
    makes the test with a `torch.device`. The values are the same (the copy was exact), and
    so is every update: the optimizer writes the partition the parameters are gathered from,
    which DeepSpeed's own copy back after each step only repeats. Without the method (another
    DeepSpeed), nothing is changed: the run only holds the copy."""
    import torch
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    original = getattr(Stage3, "_create_fp32_partitions", None)
    if not fp32_parameters or original is None:
        yield
        return

    def create(optimizer: Any) -> None:
        name = optimizer.device
        if optimizer.offload_optimizer or not isinstance(name, str):
            return original(optimizer)
        optimizer.device = torch.device(name)
        try:
            return original(optimizer)
        finally:
            optimizer.device = name

    Stage3._create_fp32_partitions = create
    try:
        yield
    finally:
        Stage3._create_fp32_partitions = original


def ulysses_attention(core: str, attn: Any, **settings: Any) -> Any:
    """DeepSpeed's Ulysses attention around `attn`, the core attention transformers registers
    as `core`, set up as DeepSpeed's register_with_transformers sets it up (it tells the
    attention its core's name), without that function's replacing `core` in transformers'
    global registry: accord registers the Ulysses attention under a name of its own."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    attention = UlyssesSPAttentionHF(attn=attn, **settings)
    _internal(attention, "core_attn_implementation", "engine.sequence_parallel", "set engine.sequence_parallel=1")
    attention.core_attn_implementation = core
    return attention
