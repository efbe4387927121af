"""The progress bar: step, loss, learning rate, tokens/s and ETA, on rank 0 only."""

from __future__ import annotations

import sys

from tqdm import tqdm

from accord.distributed.rank_env import leads


def announce(message: str) -> None:
    """One line on stderr saying what the run is doing now, from rank 0's process only."""
    if leads():
        print(f"accord: {message}", file=sys.stderr, flush=True)


def item_bar(total: int, desc: str, enabled: bool = True) -> tqdm:
    """A bar over items (examples being tokenized, ...) that appears only when the work takes
    longer than ~3 s, on stderr like every other run message."""
    return tqdm(
        total=total,
        desc=desc,
        unit="ex",
        file=sys.stderr,
        delay=3.0,
        dynamic_ncols=True,
        mininterval=0.5 if sys.stderr.isatty() else 10.0,
        disable=not enabled or not leads(),
        leave=False,
    )


def byte_bar(total: int | None, desc: str) -> tqdm:
    """A bar over bytes of input (MB/s and, when the total is known, an ETA), shown once the
    work takes longer than ~3 s."""
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1000,
        file=sys.stderr,
        delay=3.0,
        dynamic_ncols=True,
        mininterval=0.5 if sys.stderr.isatty() else 10.0,
        disable=not leads(),
        leave=False,
    )


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
