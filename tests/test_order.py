import numpy as np
import pytest

from accord.data.order import GlobalOrder


def test_same_seed_same_order_and_epochs_differ():
    a, b = GlobalOrder(100, 10, seed=3), GlobalOrder(100, 10, seed=3)
    assert all(np.array_equal(a.batch(s), b.batch(s)) for s in range(25))
    assert not np.array_equal(a.epoch_order(0), a.epoch_order(1))


def test_an_epoch_visits_each_example_at_most_once():
    order = GlobalOrder(105, 10, seed=0)
    seen = np.concatenate([order.batch(s) for s in range(order.steps_per_epoch)])
    assert len(seen) == 100 and len(set(seen.tolist())) == 100


def test_position_is_a_function_of_the_step_only():
    order = GlobalOrder(100, 10, seed=0)
    assert (order.position(23).epoch, order.position(23).index) == (2, 30)
    fresh = GlobalOrder(100, 10, seed=0)
    assert np.array_equal(fresh.batch(23), order.batch(23))  # no replay needed to get there


def test_unshuffled_order_is_the_file_order():
    order = GlobalOrder(20, 5, seed=0, shuffle=False)
    assert order.batch(1).tolist() == [5, 6, 7, 8, 9]


def test_too_little_data_for_one_batch():
    with pytest.raises(ValueError, match="only 4 training examples"):
        GlobalOrder(4, 8, seed=0)
