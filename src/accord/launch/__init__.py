"""Starting a run: validate once, spawn local workers (torch's elastic agent) or join an outer launcher,
multi-node meeting, launcher interop (accelerate, DeepSpeed, torchrun, srun), preflight, watchdog.

The top of the library: may import every layer below it."""
