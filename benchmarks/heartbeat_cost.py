"""What the hang watchdog's heartbeats cost the training loop, in one run.

    python benchmarks/heartbeat_cost.py [--calls 1000000] [--steps 30]

Prints a table: the time of one `heartbeat.phase()` call with the watchdog off (nothing is
written) and on (a memory-mapped progress file, as under accord's launcher), of one
`heartbeat.tick()`, and the share of a training step they take: the loop calls phase()
2 × accumulation + 3 times per step (forward and backward per micro-step, optimizer step,
the step-end flags, sometimes eval / checkpoint). The step time is the median of `--steps`
steps of the test suite's tiny Llama (hidden 32 × 2 layers, 8 × 32 tokens, fp32, one process
on the CPU): about the shortest step accord runs, so the largest share; a real model's step is
longer and the share smaller.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def per_call_ns(fn, calls: int) -> float:
    start = time.perf_counter_ns()
    for i in range(calls):
        fn(i)
    return (time.perf_counter_ns() - start) / calls


def step_seconds(steps: int) -> float:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=260,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 260, (8, 32))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--accumulation", type=int, default=4)
    args = parser.parse_args()

    from accord.observe import heartbeat

    off = per_call_ns(lambda i: heartbeat.phase("forward", i), args.calls)
    with tempfile.TemporaryDirectory() as folder:
        os.environ[heartbeat.DUMP_DIR_ENV] = folder
        heartbeat.start(300.0, rank=0, local_rank=0, world_size=2, restart=0)
        on = per_call_ns(lambda i: heartbeat.phase("backward/all-reduce", i), args.calls)
        tick = per_call_ns(lambda i: heartbeat.tick(), args.calls)
    step = step_seconds(args.steps)
    per_step = 2 * args.accumulation + 3
    rows = [
        ("phase(), watchdog off", off, per_step),
        ("phase(), watchdog on (mmap)", on, per_step),
        ("tick() (eval batches), on", tick, 1),
    ]
    print(
        f"step of the reference model: {step * 1e3:.1f} ms (median of {args.steps - 2}); "
        f"accumulation {args.accumulation}"
    )
    print(f"{'call':32} {'ns/call':>8} {'calls/step':>10} {'share of a step':>16}")
    for name, ns, calls in rows:
        print(f"{name:32} {ns:8.0f} {calls:10d} {ns * calls / (step * 1e9):16.2e}")


if __name__ == "__main__":
    main()
