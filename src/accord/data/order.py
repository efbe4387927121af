"""The global data order: one seeded permutation per epoch, the same for any world size.

Global batch `g` is the fixed slice [g*G, (g+1)*G) of the epoch's permutation, so the
position in the data is just the step number: resuming needs no replay, and how the
batch is split over ranks and micro-steps (BatchPlan.micro_slice) cannot change it.

The permutation is never stored: position i of an epoch maps to example p(i), where p is
a keyed bijection (a balanced Feistel network over the smallest power of 4 >= n, with
cycle-walking back into [0, n)), keyed by (seed, epoch). A batch costs O(G) to compute and
nothing grows with the corpus (a stored permutation was 8 bytes per row on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from accord.errors import UserInputError


# What checkpoints record of the order they were taken in: a run resumed under another
# order would see other examples at the same steps. "" is a checkpoint from before this was
# recorded (a stored numpy permutation); the unshuffled order ("file") never changed.
ORDER_VERSION = "feistel-1"
ROUNDS = 6


@dataclass(frozen=True)
class Position:
    epoch: int
    index: int  # first example of the batch within the epoch's order


class GlobalOrder:
    def __init__(
        self, num_examples: int, global_batch_size: int, seed: int, shuffle: bool = True, group_lengths: np.ndarray | None = None
    ):
        if num_examples < global_batch_size:
            raise UserInputError(
                f"only {num_examples} training examples but batch.global_batch_size={global_batch_size}; "
                f"lower the global batch or add data"
            )
        self.num_examples = num_examples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.group_lengths = group_lengths
        # The tail that does not fill a whole global batch is left out of that epoch
        # (a different tail every epoch when shuffling), so every step sees G examples.
        self.steps_per_epoch = num_examples // global_batch_size
        self._cached_epoch = -1
        self._cached_order: np.ndarray | None = None  # group_by_length only: its windows are sorted

    @property
    def version(self) -> str:
        return order_version(self.shuffle)

    def examples_at(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The examples at `positions` of epoch `epoch`'s order."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.group_lengths is not None:
            return self._grouped(epoch)[positions]
        if not self.shuffle:
            return positions
        return Bijection(self.num_examples, self.seed, epoch)(positions)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The whole epoch's order (O(n): for tests and small data; batches never need it)."""
        return self.examples_at(epoch, np.arange(self.num_examples))

    def _grouped(self, epoch: int) -> np.ndarray:
        if epoch != self._cached_epoch:
            order = Bijection(self.num_examples, self.seed, epoch)(np.arange(self.num_examples)) if self.shuffle else np.arange(self.num_examples)
            self._cached_order = self._group_by_length(order, np.random.default_rng([self.seed, epoch]))
            self._cached_epoch = epoch
        assert self._cached_order is not None
        return self._cached_order

    def _group_by_length(self, order: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Sort windows of 50 global batches by length, then shuffle whole batches: each
        batch holds similar lengths (less padding) and the order is still global and seeded."""
        assert self.group_lengths is not None
        g = self.global_batch_size
        window = 50 * g
        chunks = [order[i : i + window] for i in range(0, len(order), window)]
        grouped = np.concatenate([c[np.argsort(-self.group_lengths[c], kind="stable")] for c in chunks])
        usable = self.steps_per_epoch * g
        batches = grouped[:usable].reshape(self.steps_per_epoch, g)
        return np.concatenate([batches[rng.permutation(self.steps_per_epoch)].reshape(-1), grouped[usable:]])

    def position(self, step: int) -> Position:
        epoch, batch = divmod(step, self.steps_per_epoch)
        return Position(epoch, batch * self.global_batch_size)

    def batch(self, step: int) -> np.ndarray:
        """Example indices of global batch `step` (0-based), in order."""
        pos = self.position(step)
        return self.examples_at(pos.epoch, np.arange(pos.index, pos.index + self.global_batch_size))


def order_version(shuffle: bool) -> str:
    return ORDER_VERSION if shuffle else "file"


def same_order(saved: str, shuffle: bool) -> bool:
    """Whether a checkpoint that recorded order `saved` continues in this recipe's order."""
    return saved == order_version(shuffle) or (saved == "" and not shuffle)


class Bijection:
    """A seeded permutation of [0, n) evaluated pointwise: a ROUNDS-round balanced Feistel
    network on 2*half-bit numbers (a bijection of [0, 4**half) for any round function),
    applied again to any value that lands at or past n (cycle-walking: the walk stays
    inside the cycle it started on, so it returns a value < n and the map stays a
    bijection of [0, n); the domain is < 4n, so fewer than 4 passes are expected)."""

    def __init__(self, n: int, seed: int, epoch: int):
        self.n = n
        self.half = max(1, (int(n - 1).bit_length() + 1) // 2)
        self.keys = np.random.default_rng([seed, epoch]).bit_generator.random_raw(ROUNDS).astype(np.uint64)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = self._feistel(np.asarray(x, dtype=np.uint64))
        outside = y >= self.n
        while outside.any():
            y[outside] = self._feistel(y[outside])
            outside = y >= self.n
        return y.astype(np.int64)

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        half, mask = np.uint64(self.half), np.uint64((1 << self.half) - 1)
        left, right = x >> half, x & mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << half) | right


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every output bit depends on every input bit (uint64 wraps)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))
