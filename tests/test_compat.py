"""Canaries for accord.compat: one per reach-in to another library's private API. Each checks
that the private thing still exists and behaves as accord assumes, so that upgrading a
library fails here, with a message saying what changed, before it fails inside a run."""

from __future__ import annotations

import importlib.util
import inspect
import os

import pytest

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")


# ---------------------------------------------------------------- DeepSpeed


@pytest.fixture(scope="module")
def deepspeed_classes():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedEngine, DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3


def _assigns(cls, attribute: str) -> bool:
    """Whether `cls`'s source sets `self.<attribute>` (an instance attribute made in __init__
    or a method it calls: checked without building a distributed engine)."""
    return f"self.{attribute} =" in inspect.getsource(cls)


@needs_deepspeed
def test_deepspeed_is_a_version_compat_deepspeed_was_written_for(deepspeed_classes):
    from accord.compat import deepspeed as ds_compat

    assert ds_compat.untested_version() is None, (
        f"DeepSpeed {ds_compat.untested_version()} is newer or older than accord.compat.deepspeed.WRITTEN_FOR "
        f"({ds_compat.written_for()}): check the canaries below pass, then widen WRITTEN_FOR"
    )


@needs_deepspeed
def test_deepspeed_engine_keeps_the_base_optimizer(deepspeed_classes):
    engine, _, _ = deepspeed_classes
    assert _assigns(engine, "basic_optimizer"), "DeepSpeedEngine no longer keeps `basic_optimizer` (base_optimizer)"


@needs_deepspeed
def test_deepspeed_zero12_relinks_its_optimizer_state_views_on_request(deepspeed_classes):
    _, zero, _ = deepspeed_classes
    relink = getattr(zero, "_lazy_init_hp_params_optimizer_state", None)
    assert callable(relink), "DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state is gone (relink)"
    assert list(inspect.signature(relink).parameters) == ["self"]
    # relink_optimizer_state clears this flag so that the method links again.
    assert "self._hp_optimizer_states_linked" in inspect.getsource(relink), (
        "_lazy_init_hp_params_optimizer_state no longer checks _hp_optimizer_states_linked"
    )
    assert _assigns(zero, "_hp_optimizer_states_linked")


@needs_deepspeed
def test_deepspeed_zero3_keeps_its_flat_partitions(deepspeed_classes):
    _, _, stage3 = deepspeed_classes
    for name in ("fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat"):
        assert _assigns(stage3, name), f"DeepSpeedZeroOptimizer_Stage3 no longer keeps `{name}`"


@needs_deepspeed
@pytest.mark.parametrize("which", [1, 2])
def test_deepspeed_loss_scale_is_readable_and_settable(deepspeed_classes, which):
    cls = deepspeed_classes[which]
    prop = inspect.getattr_static(cls, "loss_scale", None)
    assert isinstance(prop, property) and prop.fset is not None, f"{cls.__name__}.loss_scale has no setter"


@needs_deepspeed
def test_deepspeed_zero3_still_copies_fp32_partitions_it_could_reuse(deepspeed_classes):
    """The comparison reuse_fp32_partitions works around: a `torch.device` against the
    optimizer's device name. If DeepSpeed compares properly, the swap is a no-op."""
    import torch

    _, _, stage3 = deepspeed_classes
    create = getattr(stage3, "_create_fp32_partitions", None)
    assert callable(create), "DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions is gone: fp32 partitions are copied"
    assert list(inspect.signature(create).parameters) == ["self"]
    source = inspect.getsource(create)
    assert ".device == self.device" in source, "DeepSpeed changed how ZeRO-3 decides to reuse fp32 partitions"
    assert "current_device_name()" in inspect.getsource(stage3.__init__), "ZeRO-3's device is no longer a name"
    assert torch.device("cpu") != "cpu", "torch now compares a device with its name: the swap is not needed"


@needs_deepspeed
def test_reuse_fp32_partitions_swaps_the_method_only_while_it_lasts(deepspeed_classes):
    from accord.compat.deepspeed import reuse_fp32_partitions

    _, _, stage3 = deepspeed_classes
    original = stage3._create_fp32_partitions
    with reuse_fp32_partitions(True):
        assert stage3._create_fp32_partitions is not original
    assert stage3._create_fp32_partitions is original
    with reuse_fp32_partitions(False):  # an fp16 run: its partitions are no fp32 copy to spare
        assert stage3._create_fp32_partitions is original


@needs_deepspeed
def test_a_missing_deepspeed_internal_is_one_line_naming_the_version():
    from accord.compat import IncompatibleLibrary
    from accord.compat import deepspeed as ds_compat

    class DeepSpeedZeroOptimizer:
        pass

    with pytest.raises(IncompatibleLibrary) as error:
        ds_compat.relink_optimizer_state(DeepSpeedZeroOptimizer())
    message = str(error.value)
    assert "\n" not in message
    assert "DeepSpeedZeroOptimizer has no attribute '_hp_optimizer_states_linked'" in message
    assert f"written for DeepSpeed {ds_compat.written_for()}" in message
