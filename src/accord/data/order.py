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
# data.group_by_length adds GROUPED (2: batches permuted by a bijection, not a stored
# permutation of the epoch's batches).
ORDER_VERSION = "feistel-1"
GROUPED = "+length-2"
ROUNDS = 6
GROUP_WINDOW = 50  # global batches sorted by length together (group_by_length)


@dataclass(frozen=True)
class Position:
    epoch: int
    index: int  # first example of the batch within the epoch's order


class GlobalOrder:
    def __init__(
        self,
        num_examples: int,
        global_batch_size: int,
        seed: int,
        shuffle: bool = True,
        group_lengths: np.ndarray | None = None,
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
        self._windows: dict[tuple[int, int], np.ndarray] = {}  # group_by_length: a few sorted windows

    @property
    def version(self) -> str:
        return order_version(self.shuffle, self.group_lengths is not None)

    def examples_at(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The examples at `positions` of epoch `epoch`'s order."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.group_lengths is not None:
            return self._grouped(epoch, positions)
        return self._shuffled(epoch, positions)

    def _shuffled(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        if not self.shuffle:
            return positions
        return Bijection(self.num_examples, self.seed, epoch)(positions)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The whole epoch's order (O(n): for tests and small data; batches never need it)."""
        return self.examples_at(epoch, np.arange(self.num_examples))

    def _grouped(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """group_by_length: windows of GROUP_WINDOW global batches of the shuffled order are
        each sorted by length (longest first), then whole batches are permuted by a seeded
        bijection: each batch holds similar lengths (less padding), the order is still global
        and seeded, and a batch costs one window's sort, whatever the corpus size. Positions
        past the epoch's whole batches (its tail) keep their grouped place."""
        g = self.global_batch_size
        batch, within = np.divmod(positions, g)
        permuted = Bijection(self.steps_per_epoch, self.seed, epoch, salt=1)(
            np.minimum(batch, self.steps_per_epoch - 1)
        )
        grouped = np.where(batch < self.steps_per_epoch, permuted * g + within, positions)
        window = GROUP_WINDOW * g
        out = np.empty_like(grouped)
        for w in np.unique(grouped // window):
            here = grouped // window == w
            out[here] = self._sorted_window(epoch, int(w))[grouped[here] - w * window]
        return out

    def _sorted_window(self, epoch: int, w: int) -> np.ndarray:
        key = (epoch, w)
        if key not in self._windows:
            window = GROUP_WINDOW * self.global_batch_size
            members = self._shuffled(epoch, np.arange(w * window, min((w + 1) * window, self.num_examples)))
            if len(self._windows) >= 4:  # a batch needs one window; a few kept for evaluation's sweeps
                self._windows.pop(next(iter(self._windows)))
            self._windows[key] = members[np.argsort(-np.asarray(self.group_lengths[members]), kind="stable")]
        return self._windows[key]

    def position(self, step: int) -> Position:
        epoch, batch = divmod(step, self.steps_per_epoch)
        return Position(epoch, batch * self.global_batch_size)

    def batch(self, step: int) -> np.ndarray:
        """Example indices of global batch `step` (0-based), in order."""
        pos = self.position(step)
        return self.examples_at(pos.epoch, np.arange(pos.index, pos.index + self.global_batch_size))


def order_version(shuffle: bool, grouped: bool = False) -> str:
    return (ORDER_VERSION if shuffle else "file") + (GROUPED if grouped else "")


def same_order(saved: str, shuffle: bool, grouped: bool = False) -> bool:
    """Whether a checkpoint that recorded order `saved` continues in this recipe's order."""
    return saved == order_version(shuffle, grouped) or (saved == "" and not shuffle and not grouped)


class Bijection:
    """A seeded permutation of [0, n) evaluated pointwise: a ROUNDS-round balanced Feistel
    network on 2*half-bit numbers (a bijection of [0, 4**half) for any round function),
    applied again to any value that lands at or past n (cycle-walking: the walk stays
    inside the cycle it started on, so it returns a value < n and the map stays a
    bijection of [0, n); the domain is < 4n, so fewer than 4 passes are expected)."""

    def __init__(self, n: int, seed: int, epoch: int, salt: int = 0):
        self.n = n
        self.half = max(1, (int(n - 1).bit_length() + 1) // 2)
        key = [seed, epoch] + ([salt] if salt else [])  # a salt: another permutation for the same (seed, epoch)
        self.keys = np.random.default_rng(key).bit_generator.random_raw(ROUNDS).astype(np.uint64)

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
