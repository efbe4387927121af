"""`accord report OUTPUT_DIR`: the run's metrics as PNG plots and one self-contained HTML page.

Only measured quantities are plotted (never bookkeeping such as a record's timestamp or how
many prompts were generated), every axis is labelled, accuracies are percentages on a 0-100
axis and memory starts at 0. The page opens with what a reader wants first: the recipe's
gist, the final evaluation, throughput and memory; the plots and the full recipe follow.
"""

from __future__ import annotations

import base64
import html
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from accord.observe.metrics import read_metrics

STEP = "optimizer step"
# Bookkeeping in eval records, not metrics: timestamps, counts, the step itself.
_NOT_METRICS = {"kind", "step", "time", "generated", "count", "targets", "examples", "pairs", "phase"}


@dataclass
class Panel:
    name: str  # file stem
    title: str
    ylabel: str
    lines: list[tuple[str, list[tuple[int, float]]]] = field(default_factory=list)
    percent: bool = False  # values are fractions, shown as 0-100 %
    from_zero: bool = False
    log_y: bool = False  # when the values span more than a factor of 20


def is_accuracy(name: str) -> bool:
    return name.endswith(("accuracy", "f1"))


def eval_metric_names(records: list[dict]) -> list[str]:
    """The numeric metrics the eval records hold (loss included), in first-seen order."""
    names: list[str] = []
    for r in records:
        if r["kind"] != "eval":
            continue
        for k, v in r.items():
            if (
                k not in _NOT_METRICS
                and not k.endswith("_count")
                and isinstance(v, (int, float))
                and not isinstance(v, bool)
                and k not in names
            ):
                names.append(k)
    return names


def panels(records: list[dict], task: str = "") -> list[Panel]:
    """The plots of a run, each with at least one non-empty line."""
    what = f" ({task})" if task else ""
    out = [
        Panel(
            "loss",
            f"loss{what}",
            "loss per target",
            [("train", _points(records, "train", "loss")), ("held-out", _points(records, "eval", "loss"))],
            log_y=True,
        ),
    ]
    evals = [n for n in eval_metric_names(records) if n != "loss"]
    accuracies = [n for n in evals if is_accuracy(n)]
    if accuracies:
        out.append(
            Panel(
                "eval_accuracy",
                f"held-out accuracy{what}",
                "% correct",
                [(_label(n), _points(records, "eval", n)) for n in accuracies],
                percent=True,
            )
        )
    if "perplexity" in evals:
        out.append(
            Panel(
                "eval_perplexity",
                f"held-out perplexity{what}",
                "perplexity",
                [("perplexity", _points(records, "eval", "perplexity"))],
                log_y=True,
            )
        )
    for n in evals:
        if n not in accuracies and n != "perplexity":
            out.append(
                Panel(f"eval_{n}", f"held-out {_label(n)}{what}", _label(n), [(_label(n), _points(records, "eval", n))])
            )
    out += [
        Panel("learning_rate", "learning rate", "learning rate", [("lr", _points(records, "train", "lr"))]),
        Panel(
            "grad_norm",
            "gradient norm (before clipping)",
            "global L2 norm",
            [("grad norm", _points(records, "train", "grad_norm"))],
        ),
        Panel(
            "throughput",
            "throughput",
            "tokens / s",
            [
                ("tokens", _points(records, "throughput", "tokens_per_s")),
                ("target tokens", _points(records, "throughput", "target_tokens_per_s")),
            ],
            from_zero=True,
        ),
        Panel(
            "memory",
            "peak memory per process",
            "GiB",
            [
                ("during training", _points(records, "throughput", "peak_memory_gib")),
                ("at phase ends (largest rank)", _points(records, "memory", "peak_gib_max")),
            ],
            from_zero=True,
        ),
        Panel(
            "mfu",
            "model FLOPs utilisation",
            "% of peak",
            [("MFU", _points(records, "throughput", "mfu"))],
            percent=True,
            from_zero=True,
        ),
    ]
    for p in out:
        p.lines = [(label, pts) for label, pts in p.lines if pts]
    return [p for p in out if p.lines]


def render_report(out_dir: str | Path) -> Path:
    """Write OUTPUT_DIR/report/*.png and OUTPUT_DIR/report/index.html; returns the page."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out_dir = Path(out_dir)
    records = read_metrics(out_dir)
    recipe = _recipe(out_dir)
    folder = out_dir / "report"
    folder.mkdir(exist_ok=True)
    for stale in folder.glob("*.png"):
        stale.unlink()
    images = []
    for panel in panels(records, str(recipe.get("task", ""))):
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
        for label, pts in panel.lines:
            xs, ys = zip(*pts)
            ys = [100 * y for y in ys] if panel.percent else list(ys)
            if label.startswith("at phase ends"):  # one point per phase (and per resumed run): no line
                ax.plot(xs, ys, linestyle="none", marker="s", markersize=5, label=label)
            else:
                ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3, label=label)
        ax.set_title(panel.title)
        ax.set_xlabel(STEP)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(panel.ylabel)
        values = [y for _, pts in panel.lines for _, y in pts]
        if panel.log_y and min(values) > 0 and max(values) / min(values) > 20:  # a log axis only where it helps
            ax.set_yscale("log")
        elif panel.percent and panel.name.startswith("eval"):
            ax.set_ylim(0, 100)
        elif panel.from_zero:
            ax.set_ylim(
                bottom=0,
                top=max(y for _, pts in panel.lines for _, y in pts) * (100 if panel.percent else 1) * 1.15 or 1,
            )
        ax.grid(alpha=0.3)
        if len(panel.lines) > 1:
            ax.legend()
        fig.tight_layout()
        path = folder / f"{panel.name}.png"
        fig.savefig(path)
        plt.close(fig)
        images.append((panel.title, path))
    page = folder / "index.html"
    page.write_text(_html(out_dir, records, recipe, images))
    return page


def summary(records: list[dict], recipe: dict) -> list[tuple[str, str]]:
    """The page's first table: what ran, how it ended, how fast, how much memory."""
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    speed = [r for r in records if r["kind"] == "throughput"]
    rows: list[tuple[str, str]] = []
    model = recipe.get("model") or {}
    source = model.get("path") or (model.get("config") or {}).get("architecture", "")
    engine = recipe.get("engine") or {}
    batch = recipe.get("batch") or {}
    if recipe:
        rows.append(
            (
                "run",
                f"{recipe.get('task', '?')} on {source}, {engine.get('strategy', '?')}, "
                f"precision {engine.get('precision', '?')}, "
                f"global batch {batch.get('global_batch_size', '?')}",
            )
        )
    if train:
        rows.append(("steps", f"{train[-1]['step']}"))
        rows.append(("final training loss", f"{train[-1]['loss']:.4g}"))
    if evals:
        last = evals[-1]
        parts = []
        for name in eval_metric_names([last]):
            value = last[name]
            parts.append(f"{_label(name)} {100 * value:.1f}%" if is_accuracy(name) else f"{_label(name)} {value:.4g}")
        text = ", ".join(parts) + (f" ({int(last['generated'])} prompts generated)" if "generated" in last else "")
        rows.append((f"final evaluation (step {last['step']})", text))
    if speed:
        tokens = [r["tokens_per_s"] for r in speed if isinstance(r.get("tokens_per_s"), (int, float))]
        if tokens:
            rows.append(
                ("throughput", f"{statistics.median(tokens):,.0f} tokens/s (median of {len(tokens)} intervals)")
            )
        mfu = [r["mfu"] for r in speed if isinstance(r.get("mfu"), (int, float))]
        if mfu:
            rows.append(("MFU", f"{100 * statistics.median(mfu):.1f}%"))
    peaks = [r["peak_memory_gib"] for r in speed if isinstance(r.get("peak_memory_gib"), (int, float))]
    peaks += [
        r["peak_gib_max"] for r in records if r["kind"] == "memory" and isinstance(r.get("peak_gib_max"), (int, float))
    ]
    if peaks:
        rows.append(("peak memory", f"{max(peaks):.2f} GiB per process (largest)"))
    return rows


def _html(out_dir: Path, records: list[dict], recipe: dict, images: list[tuple[str, Path]]) -> str:
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary(records, recipe))
    figures = "".join(
        f'<figure><img alt="{html.escape(title)}" '
        f'src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}">'
        f"<figcaption>{html.escape(title)}</figcaption></figure>"
        for title, path in images
    )
    recipe_text = (out_dir / "recipe.yaml").read_text() if (out_dir / "recipe.yaml").exists() else "(no recipe.yaml)"
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>accord report: {html.escape(out_dir.name)}</title>"
        "<style>body{font-family:sans-serif;max-width:1300px;margin:1.5em auto;padding:0 1em}"
        ".top{display:flex;gap:2em;align-items:flex-start;flex-wrap:wrap}"
        "figure{display:inline-block;margin:.3em}figure img{width:600px}figcaption{text-align:center;color:#555}"
        "table{border-collapse:collapse}"
        "th,td{border:1px solid #ccc;padding:.3em .7em;text-align:left;vertical-align:top}"
        "pre{background:#f6f6f6;padding:.6em;max-height:26em;overflow:auto;font-size:85%}</style></head><body>"
        f"<h1>accord report: {html.escape(str(out_dir))}</h1>"
        f"<div class='top'><div><h2>summary</h2><table>{rows}</table></div>"
        f"<div><h2>recipe</h2><pre>{html.escape(recipe_text)}</pre></div></div>"
        f"<h2>plots</h2>{figures}</body></html>"
    )


def _recipe(out_dir: Path) -> dict:
    path = out_dir / "recipe.yaml"
    try:
        data = yaml.safe_load(path.read_text()) if path.exists() else {}
    except yaml.YAMLError:
        data = {}
    return data if isinstance(data, dict) else {}


def _points(records: list[dict], kind: str, key: str) -> list[tuple[int, float]]:
    return [
        (r["step"], float(r[key]))
        for r in records
        if r["kind"] == kind and isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
    ]


def _label(name: str) -> str:
    return name.replace("_accuracy", "").replace("_", " ") if name.endswith("_accuracy") else name.replace("_", " ")
