"""Data: load rows -> tokenize (task) -> global order -> per-rank micro-batch slices."""
