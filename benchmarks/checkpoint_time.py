"""How long a checkpoint blocks training, by way of writing it, in one run (ratios, not seconds:
run-to-run noise on shared CPUs is large).

    python benchmarks/checkpoint_time.py [--hidden 1024] [--layers 12] [--processes 2] [--repeats 3] [--modes ...]

Builds a Llama from a config on the CPU, shards it with FSDP2 (fully_shard per decoder layer,
then the root) over gloo, takes one AdamW step so the optimizer state exists, then writes
the whole training state (weights + AdamW moments) repeatedly, alternating:

  full-gather   what accord did before sharded checkpoints: get_state_dict(full_state_dict,
                cpu_offload) to rank 0, which writes model.safetensors + optimizer.pt
  dcp           accord's checkpoint now: every rank writes its shards (torch.distributed.checkpoint)
  dcp-async     the same with checkpoint.async: training is blocked only while the shards are
                copied to host memory; the files are written in the background
  dcp-manifest  dcp plus what a checkpoint records for verification (accord.checkpoint.manifest):
                each rank hashes its own files (sha256), rank 0 gathers the entries, hashes
                its small files and writes MANIFEST.json
  dcp-async-manifest  the same, hashing in the background writer thread

and then exports final/ both ways:

  export-full-gather  before: the full state dict gathered to rank 0, then save_pretrained
  export-streamed     now (accord.output.export): one tensor gathered at a time, appended to the
                      current safetensors shard on rank 0, shards written as they fill

It prints, per mode, the median time training is blocked (the slowest rank's), the time until
the files are complete, each rank's peak RSS growth during the save (sampled; memory an
earlier mode freed is reused without growth, so for peaks compare runs of one mode each:
`--modes full-gather export-full-gather` against `--modes dcp export-streamed`, whose
"peak RSS per rank over the whole run" lines differ only by what saving took), and the
ratio to the first mode run.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODES = ("full-gather", "dcp", "dcp-async", "dcp-manifest", "dcp-async-manifest")
EXPORTS = ("export-full-gather", "export-streamed")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _PeakRSS:
    """The highest RSS of this process while the block runs (sampled every 5 ms)."""

    def __enter__(self):
        import threading

        self.peak, self._stop = _rss_mb(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_mb())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())


def worker(rank: int, world: int, args, port: int, folder: str, results) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    from accord.checkpoint.manifest import file_entries, unlisted_entries, write_manifest
    from accord.distributed import group as accord_dist
    from accord.engine.base import unique_entries
    from accord.engine.state import save_torch_state, unshared
    from accord.models.build import build_byte_tokenizer
    from accord.output.folder import save_streamed_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=262,
        hidden_size=args.hidden,
        intermediate_size=8 * args.hidden // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 128),
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=64,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.model.rotary_emb.inv_freq = (
        model.model.rotary_emb.original_inv_freq.clone()
    )  # a non-persistent buffer meta left empty
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 262, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    params = sum(p.numel() for p in model.parameters())

    out = Path(folder)
    timings = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in [m for m in MODES if m in args.modes]:
            target = out / f"{mode}-{repeat}"
            if rank == 0:
                target.mkdir(parents=True)
            dist.barrier()
            rss0 = _rss_mb()
            with _PeakRSS() as peak:
                start = time.perf_counter()
                pending = None
                if mode == "full-gather":
                    msd, osd = get_state_dict(
                        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
                    )
                    if rank == 0:
                        save_file(unshared(msd), target / "model.safetensors")
                        torch.save(osd, target / "optimizer.pt")
                    del msd, osd
                else:
                    pending = save_torch_state(model, optimizer, target, asynchronous=mode.startswith("dcp-async"))
                blocked = time.perf_counter() - start
                if pending is not None:
                    pending.result()
                hashing = time.perf_counter()
                if mode.endswith("manifest"):  # as accord.checkpoint.store's PendingCheckpoint does before sealing
                    entries = file_entries(target, pending.files(), rank)
                    gathered = accord_dist.all_gather_objects(entries, group=pending.group)
                    if rank == 0:
                        listed = {name: entry for part in gathered for name, entry in part.items()}
                        write_manifest(target, listed | unlisted_entries(target, listed))
                    if mode == "dcp-manifest":
                        blocked = time.perf_counter() - start  # a synchronous checkpoint hashes before training goes on
                done = time.perf_counter() - start
                hashing = time.perf_counter() - hashing
            grown = peak.peak - rss0
            dist.barrier()
            timings[mode].append((blocked, done, grown, hashing))
            if rank == 0:
                shutil.rmtree(target)

    def streamed():
        for name, tensor in unique_entries(model):
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            yield name, tensor.detach().cpu()

    tokenizer = build_byte_tokenizer()
    for mode in [m for m in EXPORTS if m in args.modes]:
        target = out / mode
        dist.barrier()
        rss0 = _rss_mb()
        with _PeakRSS() as peak:
            start = time.perf_counter()
            if mode == "export-full-gather":
                full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                if rank == 0:
                    model.save_pretrained(target, state_dict=full, safe_serialization=True)
                del full
            elif rank == 0:
                target.parent.mkdir(parents=True, exist_ok=True)
                save_streamed_model(streamed(), model, tokenizer, target)
            else:
                for _ in streamed():
                    pass
            done = time.perf_counter() - start
        dist.barrier()
        timings[mode] = [(done, done, peak.peak - rss0)]
        if rank == 0:
            shutil.rmtree(target, ignore_errors=True)
    results[rank] = {
        "timings": timings,
        "params": params,
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--modes", nargs="+", default=[*MODES, *EXPORTS], choices=[*MODES, *EXPORTS])
    args = parser.parse_args()

    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tempfile.mkdtemp(prefix="accord-ckpt-time-", dir=args.dir)
    try:
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(worker, args=(args.processes, args, port, folder, results), nprocs=args.processes, join=True)
            results = dict(results)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    params = results[0]["params"]
    state_gb = params * 12 / 1e9
    print(
        f"Llama hidden {args.hidden} × {args.layers} layers: {params / 1e6:.0f}M parameters, "
        f"checkpoint {state_gb:.2f} GB "
        f"(fp32 weights + AdamW moments); fsdp on {args.processes} processes, {args.repeats} repeats, medians"
    )
    saves = [m for m in MODES if m in args.modes]
    if saves:
        print(
            f"{'mode':<12} {'blocked s':>10} {'written s':>10} {'× ' + saves[0] + ' (blocked)':>24} "
            f"{'peak RSS growth per rank MB':>28}"
        )
    blocked_of = {}
    for mode in saves:
        per_repeat = [max(results[r]["timings"][mode][i][0] for r in results) for i in range(args.repeats)]
        written = [max(results[r]["timings"][mode][i][1] for r in results) for i in range(args.repeats)]
        grown = [statistics.median(t[2] for t in results[r]["timings"][mode]) for r in sorted(results)]
        blocked_of[mode] = statistics.median(per_repeat)
        ratio = blocked_of[mode] / blocked_of[saves[0]]
        print(
            f"{mode:<12} {blocked_of[mode]:>10.2f} {statistics.median(written):>10.2f} {ratio:>24.2f} "
            f"{' / '.join(f'{g:.0f}' for g in grown):>28}"
        )
    for mode in [m for m in saves if m.endswith("manifest")]:
        hashing = statistics.median(
            max(results[r]["timings"][mode][i][3] for r in results) for i in range(args.repeats)
        )
        print(
            f"{mode}: the manifest (each rank hashing its files, the gather, rank 0 writing it) "
            f"took {hashing:.2f} s (slowest rank, median)"
        )
    for mode in [m for m in EXPORTS if m in args.modes]:
        done = max(results[r]["timings"][mode][0][1] for r in results)
        grown = " / ".join(f"{results[r]['timings'][mode][0][2]:.0f}" for r in sorted(results))
        print(f"{mode:<20} {done:>8.2f} s to write; peak RSS growth per rank MB {grown}")
    print(
        "peak RSS per rank over the whole run (MB): "
        + " / ".join(f"{results[r]['maxrss_mb']:.0f}" for r in sorted(results))
    )


if __name__ == "__main__":
    sys.exit(main())
