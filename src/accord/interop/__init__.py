"""A TRL or transformers.Trainer job brought into accord: `accord import` reads its YAML, command
line, train.py, DeepSpeed JSON and accelerate config, accounts for every key through one table
(`mapping.py`: mapped, changed in meaning, dropped with a reason, or refused with the nearest
supported value), writes the recipe, and `--verify` trains both side by side.

Sits above launch (it writes recipes the launcher reads and reuses its accelerate/DeepSpeed
readers); only the cli imports it."""
