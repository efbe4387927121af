"""One worker's run: assemble the pieces, the training loop, evaluation, the online (GRPO) step, guards.

Imports engine, tasks, data, checkpoint, output, observe; never launch or cli."""
