"""Pipeline parallelism (engine.pipeline_parallel) on torch.distributed.pipelining: the model
split into stages by decoder layer (stages.py), torch's schedules and the stage placement
they need (schedule.py), and the engine that runs a step's micro-batches through them with
torch's data parallelism over the pipelines (engine.py). Imports what engine/ may import."""
