"""The global data order: one seeded permutation per epoch, the same for any world size.

Global batch `g` is the fixed slice [g*G, (g+1)*G) of the epoch's permutation, so the
position in the data is just the step number: resuming needs no replay, and how the
batch is split over ranks and micro-steps (BatchPlan.micro_slice) cannot change it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from accord.errors import UserInputError


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
        self._cached_order: np.ndarray | None = None

    def epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._cached_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(self.num_examples) if self.shuffle else np.arange(self.num_examples)
            if self.group_lengths is not None:
                order = self._group_by_length(order, rng)
            self._cached_order = order
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
        return self.epoch_order(pos.epoch)[pos.index : pos.index + self.global_batch_size]
