"""Long rows on one process: peak memory and speed of a training step, plain loss vs chunked.

    python benchmarks/long_context.py [--lengths 1024 2048 4096 8192] [--chunks 0 1024] [--vocab 32000]

For each row length and train.loss_chunk_size (0: the plain loss over whole logits) a fresh
process builds a small Llama (hidden 256, 4 layers) with a realistic vocabulary, so that the
logits (length × vocabulary, fp32) dominate, and runs pretraining steps on one row of that
length through accord's own task (the same `loss` the trainer calls) and AdamW. It reports
the process's peak RSS (the high-water mark, model and optimizer state included), how much
of it the steps added over the model built, and tokens per second over the timed steps, of
wall-clock time and of the process's CPU time (the steadier of the two on a shared machine). A run whose
plain logits alone would pass --cap-gib is not started (others share the machine).

The first part of issue 12's benchmark: sequence parallelism and the Trainer/TRL comparison
come with sequence parallelism.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HIDDEN, LAYERS, HEADS, FFN = 256, 4, 4, 688


def one_run(length: int, chunk: int, vocab: int, steps: int, threads: int) -> dict:
    """One configuration, in this process: returns peak RSS (MiB) and tokens/s."""
    import resource

    import torch

    from accord.models import build_byte_tokenizer, build_model
    from accord.recipe import validate_recipe
    from accord.tasks import build_task

    torch.set_num_threads(threads)
    config = {"architecture": "llama", "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "max_position_embeddings": length, "vocab_size": vocab}
    recipe = validate_recipe({
        "model": {"config": config, "tokenizer": "byte"}, "task": "pretrain",
        "data": {"train": "unused.txt", "max_length": length, "packing": False},
        "batch": {"global_batch_size": 1}, "train": {"max_steps": steps, "loss_chunk_size": chunk},
    })
    tokenizer = build_byte_tokenizer()
    model = build_model(recipe.model, tokenizer, seed=0)
    task = build_task(recipe, tokenizer)
    task.configure_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    def cpu_seconds() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    times, cpu = [], []
    for _ in range(steps + 1):  # the first step (allocator warm-up, AdamW state) is not timed
        start, start_cpu = time.perf_counter(), cpu_seconds()
        out = task.loss(model, batch)
        (out.loss_sum / out.num_targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        cpu.append(cpu_seconds() - start_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mib": peak, "built_mib": built, "tokens_per_s": length * steps / sum(times[1:]),
            "tokens_per_cpu_s": length * steps / sum(cpu[1:]), "loss": float(out.loss_sum / out.num_targets)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 1024], help="train.loss_chunk_size values (0: plain loss)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one untimed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cap-gib", type=float, default=4.0, help="skip plain runs whose logits alone would pass this")
    parser.add_argument("--one", nargs=2, type=int, metavar=("LENGTH", "CHUNK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one[0], args.one[1], args.vocab, args.steps, args.threads)))
        return

    print(f"Llama hidden {HIDDEN}, {LAYERS} layers, vocabulary {args.vocab}; pretraining on one row; fp32 on the CPU, "
          f"{args.threads} threads; peak RSS of the whole process (MiB), and what the steps added over the built model")
    header = f"{'row length':>10} {'loss_chunk_size':>15} {'peak RSS':>9} {'step adds':>9} {'tokens/s':>9} {'tok/CPU-s':>9} {'loss':>8}"
    print(header)
    print("-" * len(header))
    for length in args.lengths:
        for chunk in args.chunks:
            # Plain: fp32 logits and their log-softmax, plus the gradient, each length × vocabulary.
            if chunk == 0 and 3 * 4 * length * args.vocab / 2**30 > args.cap_gib:
                print(f"{length:>10} {chunk:>15} {'skipped: plain logits alone pass the cap':>30}")
                continue
            proc = subprocess.run([sys.executable, __file__, "--one", str(length), str(chunk), "--vocab", str(args.vocab),
                                   "--steps", str(args.steps), "--threads", str(args.threads)],
                                  capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": str(args.threads)})
            if proc.returncode != 0:
                print(f"{length:>10} {chunk:>15} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"{length:>10} {chunk:>15} {r['peak_mib']:>9.0f} {r['peak_mib'] - r['built_mib']:>9.0f} {r['tokens_per_s']:>9.0f} {r['tokens_per_cpu_s']:>9.0f} {r['loss']:>8.4f}", flush=True)


if __name__ == "__main__":
    main()
