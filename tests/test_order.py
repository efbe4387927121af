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


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4097])
def test_each_epoch_is_a_permutation_and_epochs_differ(n):
    order = GlobalOrder(n, 1, seed=5)
    first = order.epoch_order(0)
    assert sorted(first.tolist()) == list(range(n))
    assert sorted(order.epoch_order(1).tolist()) == list(range(n))
    if n >= 16:
        assert not np.array_equal(first, order.epoch_order(1)) and not np.array_equal(first, np.arange(n))


def test_a_batch_of_a_huge_corpus_is_computed_alone_without_the_epochs_order():
    # A stored permutation of 10**10 rows would take 80 GB; a batch here is computed pointwise.
    order = GlobalOrder(10**10, 8, seed=0)
    batch = order.batch(9 * 10**8)
    assert len(set(batch.tolist())) == 8 and batch.min() >= 0 and batch.max() < 10**10
    assert np.array_equal(batch, GlobalOrder(10**10, 8, seed=0).batch(9 * 10**8))


def test_the_order_looks_random_to_its_position():
    n = 20000
    order = GlobalOrder(n, 10, seed=1).epoch_order(0)
    assert abs(np.corrcoef(np.arange(n), order)[0, 1]) < 0.05
    assert abs(np.corrcoef(order[:-1], order[1:])[0, 1]) < 0.05
    halves = order[: n // 2] < n // 2  # the first half of the epoch draws evenly from both halves of the data
    assert abs(halves.mean() - 0.5) < 0.03


class _CountedLengths:
    """Example lengths that count how many of them were read."""

    def __init__(self, lengths: np.ndarray):
        self.lengths, self.read = lengths, 0

    def __getitem__(self, index):
        self.read += np.size(index)
        return self.lengths[index]


def test_a_length_grouped_batch_reads_one_window_of_lengths_whatever_the_corpus_size():
    from accord.data.order import GROUP_WINDOW, same_order

    lengths = _CountedLengths(np.random.default_rng(0).integers(1, 500, 1_000_000))
    order = GlobalOrder(1_000_000, 16, seed=1, group_lengths=lengths)
    batch = order.batch(order.steps_per_epoch - 7)
    assert lengths.read <= GROUP_WINDOW * 16 and len(set(batch.tolist())) == 16
    assert np.ptp(lengths.lengths[batch]) < 0.1 * np.ptp(lengths.lengths)  # one sorted stretch of its window
    # A checkpoint of the grouped order before (a stored permutation of its batches) is another order.
    assert same_order(order.version, True, grouped=True) and not same_order("feistel-1", True, grouped=True)
