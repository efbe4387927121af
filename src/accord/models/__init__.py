"""Building or loading the model and tokenizer, and initial weights without a whole copy.

Imports recipe and distributed only."""
