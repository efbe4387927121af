"""Long rows on one process: the longest row a training step fits under a memory cap, and the
chunked loss's cost.

    python benchmarks/long_context.py [longest] [--cap-gib 2] [--limit 16384] [--contenders accord trainer trl]
    python benchmarks/long_context.py chunks [--lengths 1024 2048 4096 8192] [--chunks 0 1024] [--vocab 32000]

`longest`: for each contender (the three side by side), a fresh process per row length (1024,
2048, 4096, ... doubling, then one bisection step between the last length that fit and the
first that did not) runs
two optimizer steps (AdamW, fp32, batch 1, pretraining on one row of random tokens) on the
same small Llama (hidden 128, 2 layers, vocabulary 32,000: the logits dominate). The cap is
enforced from outside, the same for everyone: the parent reads the child's peak RSS
(VmHWM) every 50 ms and ends it as soon as it passes --cap-gib; a child that finishes
reports its own peak (getrusage), which must also be under the cap. Contenders:
  accord   accord's own task loss (train.loss_chunk_size auto: chunked for these logits) and
           memory levers (engine.activation_checkpointing: offload, engine.tiled_mlp: true)
           on the model accord builds; the step is the trainer's (loss_sum / targets, AdamW)
           without the launcher, data pipeline and checkpoints. --accord-set adds recipe
           overrides (e.g. engine.tiled_mlp=false).
  trainer  transformers.Trainer, gradient_checkpointing=True (its model computes whole logits)
  trl      TRL SFTTrainer with gradient_checkpointing=True and its fused, chunked LM head (TRL
           1.16 always uses it; loss_type nll); activation_offloading=True where TRL can run
           it (it needs an accelerator: not on a CPU-only machine)
           (the peers' runners are in long_context_peers.py)
  accord-sp2  the accord contender on two processes (torchrun, gloo) with
           engine.sequence_parallel: 2 (Ulysses, accord.engine.sequence_parallel.ulysses): each process holds
           the whole model and half of every row's tokens (accord.tasks.sequence_shards);
           gradients are summed over both (what ddp's average does with accord's loss
           scaling). The cap holds for each process (the parent reads every worker's VmHWM);
           its peak is the larger worker's, and each worker's own peak is listed.
Tokens/s is the second step's, at the longest length every contender fit (accord-sp2 runs
its two processes with half the threads each, so the cores used are the same).

`chunks`: peak RSS and speed of the loss alone, plain (0) against chunked sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_context_peers import PEER_NAMES, run_trainer, run_trl, unavailable_peers  # noqa: E402

HIDDEN, LAYERS, HEADS, FFN, VOCAB = 128, 2, 2, 344, 32000
SCRATCH = Path(os.environ.get("ACCORD_BENCH_SCRATCH", "/tmp/accord-long-context"))


def llama_config(
    length: int, vocab: int = VOCAB, hidden: int = HIDDEN, layers: int = LAYERS, heads: int = HEADS, ffn: int = FFN
) -> dict:
    return {
        "architecture": "llama",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": length,
        "vocab_size": vocab,
    }


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def random_row(length: int, vocab: int):
    import torch

    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------- contenders (each in its own process)


def _accord_model(length: int, overrides: list[str], steps: int, sequence_parallel: int = 1):
    """accord's recipe, model (with Ulysses attention under sequence_parallel > 1: collective),
    memory levers and task for one row of `length` tokens, and that row's batch."""
    import torch

    from accord.distributed.group import DistInfo
    from accord.engine.long_rows import apply_memory_levers
    from accord.engine.sequence_parallel.ulysses import install_ulysses
    from accord.models.build import build_byte_tokenizer, build_model
    from accord.recipe.schema import apply_override, validate_recipe
    from accord.tasks import build_task, task_config

    raw = {
        "model": {"config": llama_config(length), "tokenizer": "byte"},
        "task": "pretrain",
        "data": {"train": "unused.txt", "max_length": length, "packing": False},
        "batch": {"global_batch_size": 1},
        "train": {"max_steps": steps},
        "engine": {"activation_checkpointing": "offload", "tiled_mlp": True, "sequence_parallel": sequence_parallel},
    }
    for item in overrides:
        apply_override(raw, item)
    recipe = validate_recipe(raw)
    tokenizer = build_byte_tokenizer()
    model = build_model(recipe.model, tokenizer, seed=0)
    task = build_task(task_config(recipe), tokenizer)
    # Before the Ulysses attention replaces the model's, as accord.run.assemble does: the task
    # (and the sequence shards) must see the core attention, sdpa, which takes a row of one
    # document as causal without a mask (with the Ulysses name it would build the L x L mask).
    task.configure_model(model)
    if sequence_parallel > 1:
        rank = torch.distributed.get_rank()
        install_ulysses(
            sequence_parallel, model, DistInfo(rank, sequence_parallel, rank, sequence_parallel), micro_batch_size=1
        )
    apply_memory_levers(model, recipe.engine, length, torch.device("cpu"))
    model.train()
    ids = random_row(length, VOCAB)
    return model, task, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def run_accord(length: int, overrides: list[str], steps: int = 2) -> dict:
    import torch

    model, task, batch = _accord_model(length, overrides, steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = task.loss(model, batch)
        (out.loss_sum / out.num_targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return {"step_s": times[-1], "loss": float(out.loss_sum.detach() / out.num_targets)}


def run_accord_sp2(length: int, overrides: list[str], steps: int = 2) -> dict:
    """One process of two (under torchrun): accord's levers plus engine.sequence_parallel=2."""
    import torch
    import torch.distributed as dist

    from accord.tasks.sequence_shards import SequenceShards

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, task, whole = _accord_model(length, overrides, steps, sequence_parallel=world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = SequenceShards(world, rank, getattr(task, "attn_implementation", "sdpa")).shard(whole)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = task.loss(model, batch)
        targets = out.num_targets.detach().clone()
        dist.all_reduce(targets)  # each target counted once over the group
        (out.loss_sum / targets).backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)  # this rank's tokens' share of the row's gradient
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    loss = out.loss_sum.detach().clone()
    dist.all_reduce(loss)
    peaks: list = [None] * world
    dist.all_gather_object(peaks, peak_mib())
    dist.destroy_process_group()
    return {"step_s": times[-1], "loss": float(loss / targets), "peaks_mib": peaks, "rank": rank}


CONTENDERS = {"accord": run_accord, "trainer": run_trainer, "trl": run_trl, "accord-sp2": run_accord_sp2}
PEERS = ("trainer", "trl")  # long_context_peers' runners: given the model's config, the row and a work folder
MULTI_PROCESS = {"accord-sp2": 2}  # contenders that run on this many processes (torchrun)


def child(name: str, length: int, overrides: list[str]) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    if name in PEERS:
        row = random_row(length, VOCAB)[0].tolist()
        result = CONTENDERS[name](llama_config(length), row, SCRATCH / f"{name}-{length}")
    else:
        result = CONTENDERS[name](length, overrides)
    if result.pop("rank", 0) == 0:
        print(json.dumps(result | {"peak_mib": max(result.get("peaks_mib") or [peak_mib()])}))


# ---------------------------------------------------------------- the parent: cap and search


def _hwm_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _workers(pid: int) -> list[int]:
    """`pid` and every process below it (a torchrun launcher's workers)."""
    import psutil

    try:
        return [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return [pid]


def probe(name: str, length: int, cap_mib: float, overrides: list[str], threads: int) -> dict:
    """One contender at one length, ended from outside once any of its processes' peak RSS
    passes the cap (a torchrun launcher and its workers: each process is held to the cap)."""
    processes = MULTI_PROCESS.get(name, 1)
    cmd = [sys.executable, __file__, "--child", name, str(length), *[f"--accord-set={o}" for o in overrides]]
    if processes > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", *cmd[1:]]
        threads = max(1, threads // processes)
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    seen = 0.0
    while proc.poll() is None:
        seen = max([seen, *map(_hwm_mib, _workers(proc.pid) if processes > 1 else [proc.pid])])
        if seen > cap_mib:
            os.killpg(proc.pid, 9)  # the launcher and its workers (their own session)
            proc.communicate()
            return {"fits": False, "peak_mib": seen, "why": "over the cap"}
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode != 0:
        last = (err.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return {"fits": False, "peak_mib": seen, "why": last[:200]}
    result = json.loads(out.strip().splitlines()[-1])
    return result | {
        "fits": result["peak_mib"] <= cap_mib,
        "why": "over the cap",
        "wall_s": time.perf_counter() - start,
    }


def _peaks(result: dict) -> str:
    """A probe's peak RSS: each worker's for a multi-process contender."""
    return " / ".join(f"{p:.0f}" for p in result.get("peaks_mib") or [result["peak_mib"]])


def longest(
    name: str, cap_mib: float, start: int, limit: int, overrides: list[str], threads: int, log
) -> tuple[int, dict[int, dict]]:
    """Doubling from `start`, then one bisection step: the longest length that fit, and every probe."""
    probes: dict[int, dict] = {}

    def run(length: int) -> bool:
        probes[length] = probe(name, length, cap_mib, overrides, threads)
        r = probes[length]
        log(
            f"  {name:>10} {length:>7}: "
            + (
                f"fits, peak {_peaks(r)} MiB, step {r['step_s']:.1f} s"
                if r["fits"]
                else f"does not fit ({r['why']}; peak seen {r['peak_mib']:.0f} MiB)"
            )
        )
        return r["fits"]

    length, best = start, 0
    while length <= limit and run(length):
        best, length = length, 2 * length
    if best and length <= limit:
        middle = (best + length) // 2
        if run(middle):
            best = middle
    return best, probes


def main_longest(args) -> None:
    SCRATCH.mkdir(parents=True, exist_ok=True)
    cap_mib = args.cap_gib * 1024
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    log(
        f"Llama hidden {HIDDEN}, {LAYERS} layers, vocabulary {VOCAB}; fp32, batch 1, {args.threads} threads; "
        f"cap {args.cap_gib:g} GiB peak RSS per process"
    )
    # The contenders search side by side (each its own process at a time): peak memory does not
    # depend on what else runs; step times do, so compare them within one run only.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(args.contenders)) as pool:
        futures = {
            name: pool.submit(
                longest,
                name,
                cap_mib,
                args.start,
                args.limit,
                args.accord_set if name == "accord" else [],
                args.threads,
                log,
            )
            for name in args.contenders
        }
        results = {name: future.result() for name, future in futures.items()}
    common = min(best for best, _ in results.values())
    print(
        f"| contender | longest row under {args.cap_gib:g} GiB | peak RSS there (MiB, per process) "
        f"| tokens/s at {common} tokens |"
    )
    print("|---|---|---|---|")
    for name, (best, probes) in results.items():
        there = probes.get(best, {})
        at_common = probes.get(common)
        speed = f"{common / at_common['step_s']:.0f}" if at_common and at_common.get("fits") else "not measured"
        print(f"| {name} | {best or 'none'} | {_peaks(there) if there else 0} | {speed} |")
    for name, why in unavailable_peers():
        print(f"| {name} | cannot run here: {why} | | |")
    import shutil

    shutil.rmtree(SCRATCH, ignore_errors=True)
    peers = {n: best for n, (best, _) in results.items() if not n.startswith("accord")}
    if "accord" in results and peers:
        peer = max(peers, key=lambda n: peers[n] or 0)
        print(f"accord / best peer: {(results['accord'][0] or 0) / max(peers[peer] or 1, 1):.2f}x ({PEER_NAMES[peer]})")


# ---------------------------------------------------------------- the chunked loss alone


def one_chunk_run(length: int, chunk: int, vocab: int, steps: int, threads: int) -> dict:
    """One configuration, in this process: returns peak RSS (MiB) and tokens/s."""
    import torch

    from accord.models.build import build_byte_tokenizer, build_model
    from accord.recipe.schema import validate_recipe
    from accord.tasks import build_task, task_config

    torch.set_num_threads(threads)
    recipe = validate_recipe(
        {
            "model": {"config": llama_config(length, vocab, 256, 4, 4, 688), "tokenizer": "byte"},
            "task": "pretrain",
            "data": {"train": "unused.txt", "max_length": length, "packing": False},
            "batch": {"global_batch_size": 1},
            "train": {"max_steps": steps, "loss_chunk_size": chunk},
        }
    )
    tokenizer = build_byte_tokenizer()
    model = build_model(recipe.model, tokenizer, seed=0)
    task = build_task(task_config(recipe), tokenizer)
    task.configure_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = random_row(length, vocab)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    built = peak_mib()

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
    return {
        "peak_mib": peak_mib(),
        "built_mib": built,
        "tokens_per_s": length * steps / sum(times[1:]),
        "tokens_per_cpu_s": length * steps / sum(cpu[1:]),
        "loss": float(out.loss_sum.detach() / out.num_targets),
    }


def main_chunks(args) -> None:
    print(
        f"Llama hidden 256, 4 layers, vocabulary {args.vocab}; pretraining on one row; fp32 on the CPU, "
        f"{args.threads} threads; peak RSS of the whole process (MiB), and what the steps added over the built model"
    )
    header = (
        f"{'row length':>10} {'loss_chunk_size':>15} {'peak RSS':>9} {'step adds':>9} "
        f"{'tokens/s':>9} {'tok/CPU-s':>9} {'loss':>8}"
    )
    print(header)
    print("-" * len(header))
    for length in args.lengths:
        for chunk in args.chunks:
            # Plain: fp32 logits and their log-softmax, plus the gradient, each length × vocabulary.
            if chunk == 0 and 3 * 4 * length * args.vocab / 2**30 > args.cap_gib:
                print(f"{length:>10} {chunk:>15} {'skipped: plain logits alone pass the cap':>30}")
                continue
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--chunk-run",
                    str(length),
                    str(chunk),
                    "--vocab",
                    str(args.vocab),
                    "--steps",
                    str(args.steps),
                    "--threads",
                    str(args.threads),
                ],
                capture_output=True,
                text=True,
                env=os.environ | {"OMP_NUM_THREADS": str(args.threads)},
            )
            if proc.returncode != 0:
                print(
                    f"{length:>10} {chunk:>15} failed: "
                    f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"
                )
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            print(
                f"{length:>10} {chunk:>15} {r['peak_mib']:>9.0f} {r['peak_mib'] - r['built_mib']:>9.0f} "
                f"{r['tokens_per_s']:>9.0f} "
                f"{r['tokens_per_cpu_s']:>9.0f} {r['loss']:>8.4f}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", nargs="?", choices=["longest", "chunks"], default="longest")
    parser.add_argument(
        "--cap-gib",
        type=float,
        default=None,
        help="longest: the per-process peak RSS cap (default 2); "
        "chunks: skip plain runs whose logits alone would pass it (default 4)",
    )
    parser.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=list(CONTENDERS))
    parser.add_argument("--start", type=int, default=1024, help="longest: the first row length")
    parser.add_argument(
        "--limit", type=int, default=16384, help="longest: the longest row length tried (16384 keeps it to minutes)"
    )
    parser.add_argument(
        "--accord-set", action="append", default=[], help="longest: a recipe override for accord (repeatable)"
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument(
        "--chunks", nargs="+", default=["0", "1024"], help="chunks: train.loss_chunk_size values (0: plain loss)"
    )
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--steps", type=int, default=2, help="chunks: timed steps after one untimed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("CONTENDER", "LENGTH"), help=argparse.SUPPRESS)
    parser.add_argument("--chunk-run", nargs=2, metavar=("LENGTH", "CHUNK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.accord_set)
    elif args.chunk_run:
        chunk = args.chunk_run[1] if args.chunk_run[1] == "auto" else int(args.chunk_run[1])
        print(json.dumps(one_chunk_run(int(args.chunk_run[0]), chunk, args.vocab, args.steps, args.threads)))
    elif args.mode == "chunks":
        args.cap_gib = 4.0 if args.cap_gib is None else args.cap_gib
        args.chunks = [c if c == "auto" else int(c) for c in args.chunks]
        main_chunks(args)
    else:
        args.cap_gib = 2.0 if args.cap_gib is None else args.cap_gib
        main_longest(args)


if __name__ == "__main__":
    main()
