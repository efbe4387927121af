import pytest

from accord.distributed.batch_plan import BatchPlan, BatchPlanError


@pytest.mark.parametrize(
    "world, micro, accum",
    [(1, 8, 4), (2, 8, 2), (2, 4, 4), (4, 8, 1), (8, 1, 4)],
)
def test_accumulation_is_derived_from_the_world_size(world, micro, accum):
    plan = BatchPlan.derive(32, micro, world)
    assert plan.grad_accum == accum
    assert plan.world_size * plan.micro_batch_size * plan.grad_accum == 32


def test_no_micro_batch_means_no_accumulation():
    plan = BatchPlan.derive(32, None, 4)
    assert (plan.micro_batch_size, plan.grad_accum) == (8, 1)


def test_micro_batch_that_does_not_divide_lists_valid_choices():
    with pytest.raises(BatchPlanError) as e:
        BatchPlan.derive(32, 3, 2)
    assert "batch.micro_batch_size=3" in str(e.value)
    assert "valid micro_batch_size values for 2 processes: 1, 2, 4, 8, 16" in str(e.value)


def test_global_batch_not_divisible_by_world_size():
    with pytest.raises(BatchPlanError, match="cannot be split over 4 processes.*or run on 1, 2, 3 or 6 processes"):
        BatchPlan.derive(6, None, 4)


@pytest.mark.parametrize("world, micro", [(1, 8), (2, 8), (2, 4), (4, 2), (8, 4)])
def test_micro_slices_cover_the_global_batch_exactly_once(world, micro):
    plan = BatchPlan.derive(32, micro, world)
    seen = [i for r in range(world) for m in range(plan.grad_accum) for i in range(32)[plan.micro_slice(r, m)]]
    assert sorted(seen) == list(range(32))


def test_describe_reads_as_the_product():
    assert (
        BatchPlan.derive(32, 8, 2).describe()
        == "2 processes × 8 sequences × 2 accumulation steps = 32 sequences per optimizer step"
    )
