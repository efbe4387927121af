"""The run's output folder: refusal to clobber, the lock, atomic writes, the final HF export.

Imports models and distributed; never the loop."""
