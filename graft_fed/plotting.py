"""Learning curves of run directories (metrics.jsonl) to PNG.

One run: `learning_curves.png` (held-out pass@1 with its standard error as error bars) and,
for a node or co-training member that received peer groups, `federation.png`: groups
received per step and from whom, the admitted share of peer responses, and the quantiles
of s. Several runs (or a sim's folder, whose node runs it holds): the same panels with one
line per run, to compare them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Sequence

from graft_fed.errors import DataError
from graft_fed.trainer.metrics import read_metrics

PANELS = [
    ("reward", "train reward (mean)"),
    ("eval/pass@1", "held-out pass@1 (error bars: 1 standard error)"),
    ("frac_all_fail", "share of all-fail groups"),
    ("completions/mean_length", "mean response length (tokens)"),
    ("entropy", "token entropy"),
    ("clip_ratio/region_mean", "clipped token share"),
    ("grad_norm", "grad norm"),
    ("time/step", "seconds per step"),
]
FROM = re.compile(r"^graft/from/(.+)/replaced$")


def run_dirs(paths: Sequence[str | Path]) -> list[Path]:
    """Run folders: each path that holds metrics.jsonl, or the run folders directly inside a
    path that does not (a sim's or an experiment's output folder)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if (p / "metrics.jsonl").is_file():
            out.append(p)
            continue
        children = sorted(c for c in p.glob("*") if (c / "metrics.jsonl").is_file()) if p.is_dir() else []
        if not children:
            raise DataError(f"{p} has no metrics.jsonl, nor run folders that do; is it a run directory "
                            "(run.output_dir) or a sim's output folder?")
        out += children
    return out


def _rows(run: Path) -> list[dict[str, Any]]:
    try:
        return [r for r in read_metrics(run / "metrics.jsonl") if "step" in r]
    except ValueError as exc:
        raise DataError(str(exc)) from None


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _draw_metric(ax, rows, key: str, label: str | None, color=None) -> None:
    xs, ys = _series(rows, key)
    if key == "eval/pass@1":
        errs = [r.get("eval/stderr") if isinstance(r.get("eval/stderr"), (int, float)) else 0.0
                for r in rows if isinstance(r.get(key), (int, float))]
        ax.errorbar(xs, ys, yerr=errs, marker="o", markersize=4, linewidth=1.2, capsize=3, label=label, color=color)
    else:
        ax.plot(xs, ys, linewidth=1.2, label=label, color=color)


def _grid(plt, n: int, cols: int = 2):
    rows_n = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(11, 3 * rows_n), squeeze=False)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    return fig, list(axes.flat)[:n]


def _has_federation(rows: list[dict[str, Any]]) -> bool:
    return any(isinstance(r.get("graft/replaced"), (int, float)) for r in rows)


def _federation_single(plt, name: str, rows: list[dict[str, Any]], target: Path) -> Path:
    sources = sorted({m.group(1) for r in rows for k in r for m in [FROM.match(k)] if m})
    fig, axes = _grid(plt, 4)
    steps = [r["step"] for r in rows if "reward" in r]
    train = [r for r in rows if "reward" in r]
    bottom = [0.0] * len(train)
    for src in sources:
        vals = [float(r.get(f"graft/from/{src}/replaced") or 0.0) for r in train]
        axes[0].bar(steps, vals, bottom=bottom, label=src, width=0.8)
        bottom = [b + v for b, v in zip(bottom, vals)]
    axes[0].set_title("peer groups received per step, by source", fontsize=10)
    if sources:
        axes[0].legend(fontsize=8)
    total = 0.0
    cum_x, cum_y = [], []
    for r in train:
        total += float(r.get("graft/replaced") or 0.0)
        cum_x.append(r["step"])
        cum_y.append(total)
    axes[1].plot(cum_x, cum_y, linewidth=1.4, color="black", label="all sources")
    for src in sources:
        acc, ys = 0.0, []
        for r in train:
            acc += float(r.get(f"graft/from/{src}/replaced") or 0.0)
            ys.append(acc)
        axes[1].plot(cum_x, ys, linewidth=1.0, label=src)
    axes[1].set_title("peer groups received, cumulative", fontsize=10)
    axes[1].legend(fontsize=8)
    xs, ys = _series(train, "graft/admitted_frac")
    axes[2].plot(xs, ys, marker=".", linewidth=1.2, color="black", label="all sources")
    for src in sources:
        sx, sy = _series(train, f"graft/from/{src}/admitted_frac")
        axes[2].plot(sx, sy, marker=".", linewidth=0.8, label=src)
    axes[2].set_ylim(-0.02, 1.02)
    axes[2].set_title("admitted share of peer responses (s > delta)", fontsize=10)
    axes[2].legend(fontsize=8)
    x10, p10 = _series(train, "graft/s_p10")
    x50, p50 = _series(train, "graft/s_p50")
    x90, p90 = _series(train, "graft/s_p90")
    if x10 and len(x10) == len(x90):
        axes[3].fill_between(x10, p10, p90, alpha=0.25, label="p10-p90")
    axes[3].plot(x50, p50, linewidth=1.2, label="median")
    axes[3].set_title("s of received peer responses (importance ratio)", fontsize=10)
    axes[3].legend(fontsize=8)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{name}: federation")
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def plot_runs(paths: Sequence[str | Path], out_dir: str | Path | None = None) -> list[Path]:
    """Draw one run, or overlay several; returns the PNGs written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = run_dirs(paths)
    data = {run: _rows(run) for run in runs}
    names = [run.name if [r.name for r in runs].count(run.name) == 1 else str(run) for run in runs]
    if out_dir:
        out = Path(out_dir)
    elif len(runs) == 1:
        out = runs[0] / "plots"
    else:
        out = Path(os.path.commonpath([str(r.resolve()) for r in runs])) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    all_rows = [r for rows in data.values() for r in rows]
    panels = [(k, t) for k, t in PANELS if any(isinstance(r.get(k), (int, float)) for r in all_rows)]
    if not panels:
        raise DataError(f"{', '.join(map(str, runs))}: no plottable metrics yet")
    written: list[Path] = []
    fig, axes = _grid(plt, len(panels))
    for ax, (key, title) in zip(axes, panels):
        for name, rows in zip(names, data.values()):
            _draw_metric(ax, rows, key, name if len(runs) > 1 else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(names[0] if len(runs) == 1 else f"{len(runs)} runs: " + ", ".join(names))
    fig.tight_layout()
    target = out / ("learning_curves.png" if len(runs) == 1 else "compare_learning_curves.png")
    fig.savefig(target, dpi=110)
    plt.close(fig)
    written.append(target)
    fed_runs = [(name, rows) for name, rows in zip(names, data.values()) if _has_federation(rows)]
    if len(runs) == 1 and fed_runs:
        written.append(_federation_single(plt, names[0], fed_runs[0][1], out / "federation.png"))
    elif fed_runs:
        fig, axes = _grid(plt, 3)
        for name, rows in fed_runs:
            train = [r for r in rows if "reward" in r]
            xs, ys = _series(train, "graft/replaced")
            axes[0].plot(xs, ys, linewidth=1.2, label=name)
            xs, ys = _series(train, "graft/admitted_frac")
            axes[1].plot(xs, ys, marker=".", linewidth=1.0, label=name)
            xs, ys = _series(train, "graft/s_p50")
            axes[2].plot(xs, ys, linewidth=1.0, label=name)
        for ax, title in zip(axes, ("peer groups received per step", "admitted share of peer responses",
                                    "median s of received peer responses")):
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle("federation: " + ", ".join(n for n, _ in fed_runs))
        fig.tight_layout()
        target = out / "compare_federation.png"
        fig.savefig(target, dpi=110)
        plt.close(fig)
        written.append(target)
    return written


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """One run's plots (kept for callers of the one-run form)."""
    return plot_runs([run_dir], out_dir)
