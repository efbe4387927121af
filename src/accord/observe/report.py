"""`accord report OUTPUT_DIR`: the run's metrics as PNG plots and one self-contained HTML page."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from accord.observe.metrics import read_metrics

_PANELS = [
    ("loss", "loss", [("train", "loss", "train"), ("eval", "loss", "eval")]),
    ("eval_metrics", "held-out metrics", None),  # every eval metric except loss / counts
    ("learning_rate", "learning rate", [("train", "lr", "lr")]),
    ("throughput", "tokens per second", [("throughput", "tokens_per_s", "tokens"), ("throughput", "target_tokens_per_s", "target tokens")]),
    ("memory", "peak memory (GiB)", [("throughput", "peak_memory_gib", "peak memory")]),
    ("mfu", "model FLOPs utilisation", [("throughput", "mfu", "MFU")]),
]
_NOT_PLOTTED = {"loss", "perplexity", "generated", "step", "kind"}


def render_report(out_dir: str | Path) -> Path:
    """Write OUTPUT_DIR/report/*.png and OUTPUT_DIR/report/index.html; returns the page."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    records = read_metrics(out_dir)
    folder = out_dir / "report"
    folder.mkdir(exist_ok=True)
    images = []
    for name, title, series in _PANELS:
        series = series if series is not None else _eval_series(records)
        lines = [(label, _points(records, kind, key)) for kind, key, label in series]
        lines = [(label, pts) for label, pts in lines if pts]
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
        for label, pts in lines:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend()
        fig.tight_layout()
        path = folder / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        images.append((title, path))
    page = folder / "index.html"
    page.write_text(_html(out_dir, records, images))
    return page


def _points(records: list[dict], kind: str, key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records if r["kind"] == kind and isinstance(r.get(key), (int, float))]


def _eval_series(records: list[dict]) -> list[tuple[str, str, str]]:
    keys = sorted({k for r in records if r["kind"] == "eval" for k, v in r.items() if k not in _NOT_PLOTTED and isinstance(v, (int, float))})
    return [("eval", k, k.replace("_", " ")) for k in keys]


def _html(out_dir: Path, records: list[dict], images: list[tuple[str, Path]]) -> str:
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    summary = [("steps", train[-1]["step"] if train else 0), ("last training loss", _fmt(train[-1]["loss"]) if train else "-")]
    if evals:
        summary += [(f"eval {k}", _fmt(v)) for k, v in evals[-1].items() if k not in ("kind", "step")]
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in summary)
    figures = "".join(
        f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}">'
        f"<figcaption>{html.escape(title)}</figcaption></figure>"
        for title, path in images
    )
    recipe = (out_dir / "recipe.yaml").read_text() if (out_dir / "recipe.yaml").exists() else ""
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>accord report: {html.escape(out_dir.name)}</title>"
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}figure{display:inline-block;margin:.5em}"
        "table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:.2em .6em;text-align:left}</style></head><body>"
        f"<h1>accord report: {html.escape(str(out_dir))}</h1><table>{rows}</table>{figures}"
        f"<h2>recipe</h2><pre>{html.escape(recipe)}</pre></body></html>"
    )


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
