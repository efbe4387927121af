"""What a run shows and records: progress bar, JSONL metrics, TensorBoard."""
