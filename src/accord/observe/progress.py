"""The progress bar: step, loss, learning rate, tokens/s and ETA, on rank 0 only."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, total_steps: int, initial_step: int, enabled: bool):
        self._bar = (
            tqdm(
                total=total_steps,
                initial=initial_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
                # Keep the bar readable when output is a file or a CI log.
                mininterval=0.5 if sys.stderr.isatty() else 10.0,
            )
            if enabled
            else None
        )

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def show(self, loss: float, lr: float, tokens_per_s: float) -> None:
        """Latest logged numbers (updated at log intervals, where they are synchronised anyway)."""
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}")

    def write(self, line: str) -> None:
        """Print a line above the bar without breaking it."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
