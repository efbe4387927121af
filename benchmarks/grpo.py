"""accord's grpo against TRL's GRPOTrainer on 1 and 2 CPU processes: the same starting model
(a saved folder, e.g. the quickstart's final/), the same addition prompts, exact-match reward,
group size, completion length, learning rate, beta, global batch and steps.

    python benchmarks/grpo.py MODEL_FOLDER [--steps 10] [--prompts 16] [--group 8] [--processes 1 2] [--json out.json]

Each contender runs as its own program under /usr/bin/time (peak RSS of the process tree's
largest process, i.e. the peak of one process); reported per contender: wall seconds of the
steps after the first, prompts/s and completion tokens/s over those steps, peak RSS, and the
mean exact-match reward of the last step's completions (both sample with temperature 1).
accord starts its 2 processes itself (engine.processes); TRL runs under
`accelerate launch --multi_gpu --num_processes 2` (the accelerate launch that starts two
gloo processes on a CPU machine; with use_cpu it starts one), each process taking half the global batch
(per_device_train_batch_size = prompts × group / 2).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
SEED = 0
LR = 2e-4
BETA = 0.04
MAX_NEW = 4


def prompts_file(folder: Path, count: int) -> Path:
    """The addition rows accord generates from the seed (the same rows for both contenders),
    the expected sum in `answer`."""
    from accord.data.generated import generate
    from accord.recipe.schema import GeneratedData

    train, _ = generate(GeneratedData(kind="addition", train_examples=4000, eval_examples=256, max_digits=2), SEED)
    path = folder / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": r["prompt"], "answer": r["completion"]}) + "\n" for r in list(train)[: count * 40]
        )
    )
    return path


def run_accord(model: str, data: Path, out: Path, steps: int, prompts: int, group: int, processes: int) -> None:
    import yaml

    recipe = {
        "seed": SEED,
        "model": {"path": model},
        "task": "grpo",
        "data": {"train": str(data), "max_length": 32, "shuffle": False, "cache_dir": str(out / "cache")},
        "batch": {"global_batch_size": prompts},
        "optim": {"lr": LR, "schedule": "constant", "max_grad_norm": 1.0},
        "train": {"max_steps": steps, "log_every": 1},
        "grpo": {
            "group_size": group,
            "max_new_tokens": MAX_NEW,
            "beta": BETA,
            "rewards": [{"kind": "exact_match", "column": "answer"}],
        },
        "engine": {"strategy": "ddp", "processes": processes, "device": "cpu"},
        "output": {"dir": str(out / "accord"), "overwrite": True},
    }
    (out / "grpo.yaml").write_text(yaml.safe_dump(recipe))
    subprocess.run([sys.executable, "-m", "accord", "train", str(out / "grpo.yaml")], check=True)


def run_trl(model: str, data: Path, out: Path, steps: int, prompts: int, group: int, processes: int) -> None:
    """TRL's GRPOTrainer with the same settings; its loss_type dapo is accord's normalisation.
    Under accelerate launch each of the `processes` ranks takes its share of the global batch."""
    import time

    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = datasets.load_dataset("json", data_files=str(data), split="train")
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.padding_side = "left"

    def exact_match(prompts, completions, answer, **_):  # TRL keeps `completion` for itself: the answers are `answer`
        return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]

    log = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            log.append({"step": state.global_step, "time": time.perf_counter()})

    config = GRPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=prompts * group // processes,
        num_generations=group,
        gradient_accumulation_steps=1,
        max_completion_length=MAX_NEW,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_steps=steps,
        beta=BETA,
        loss_type="dapo",
        temperature=1.0,
        use_cpu=True,
        bf16=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=SEED,
        shuffle_dataset=False,
        warmup_steps=0,
        max_grad_norm=1.0,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model),
        reward_funcs=exact_match,
        args=config,
        train_dataset=rows,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    if not trainer.accelerator.is_main_process:
        return
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    lengths = [h.get("completions/mean_length", 0.0) for h in trainer.state.log_history if "reward" in h]
    (out / "trl.json").write_text(
        json.dumps(
            {"clock": log, "rewards": rewards, "lengths": lengths, "processes": trainer.accelerator.num_processes}
        )
    )


def measure(name: str, processes: int, args, out: Path) -> dict:
    launch = [sys.executable]
    if name != "accord" and processes > 1:
        launch = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(processes),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
        ]
    command = [
        "/usr/bin/time",
        "-v",
        *launch,
        str(HERE),
        args.model,
        "--run",
        name,
        "--out",
        str(out),
        "--steps",
        str(args.steps),
        "--prompts",
        str(args.prompts),
        "--group",
        str(args.group),
        "--processes",
        str(processes),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) / 2**20
    completions = args.prompts * args.group * (args.steps - 1)
    if name == "accord":
        steps = [
            json.loads(line)
            for line in (out / "accord" / "metrics.jsonl").read_text().splitlines()
            if '"kind": "train"' in line
        ]
        seconds = sum(s["step_s"] for s in steps[1:])
        tokens = sum(s["targets"] for s in steps[1:])
        reward = steps[-1]["reward"]
    else:
        trl = json.loads((out / "trl.json").read_text())
        if trl["processes"] != processes:  # the accelerate launch trap: one process where two were asked
            raise SystemExit(f"TRL ran on {trl['processes']} process(es), not {processes}")
        seconds = trl["clock"][-1]["time"] - trl["clock"][0]["time"]
        tokens = sum(trl["lengths"][1:]) * args.prompts * args.group
        reward = trl["rewards"][-1]
    return {
        "contender": name,
        "processes": processes,
        "seconds": seconds,
        "prompts_per_s": completions / args.group / seconds,
        "completion_tokens_per_s": tokens / seconds,
        "peak_rss_gib": rss,
        "last_step_reward": reward,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument(
        "--processes", type=int, nargs="+", default=[1, 2], help="process counts to run each contender on"
    )
    parser.add_argument("--json")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        out = Path(args.out)
        runner = run_accord if args.run == "accord" else run_trl
        runner(
            str(Path(args.model).resolve()),
            out / "prompts.jsonl",
            out,
            args.steps,
            args.prompts,
            args.group,
            args.processes[0],
        )
        return
    with tempfile.TemporaryDirectory(dir=os.environ.get("ACCORD_BENCH_DIR")) as tmp:
        out = Path(tmp)
        prompts_file(out, args.prompts)
        results = [measure(name, n, args, out) for n in args.processes for name in ("accord", "TRL GRPOTrainer")]
    print(f"{'contender':<18} {'procs':>5} {'s':>7} {'prompts/s':>10} {'tok/s':>8} {'RSS GiB':>8} {'reward':>7}")
    for r in results:
        print(
            f"{r['contender']:<18} {r['processes']:5d} {r['seconds']:7.1f} {r['prompts_per_s']:10.2f} "
            f"{r['completion_tokens_per_s']:8.1f} {r['peak_rss_gib']:8.2f} {r['last_step_reward']:7.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
