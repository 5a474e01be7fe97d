"""Learning curves of a run directory (metrics.jsonl) to PNG."""

from __future__ import annotations

from pathlib import Path

from graft_fed.errors import DataError
from graft_fed.trainer.metrics import read_metrics

PANELS = [
    ("reward", "train reward (mean)"),
    ("eval/pass@1", "held-out pass@1"),
    ("frac_all_fail", "share of all-fail groups"),
    ("completions/mean_length", "mean response length (tokens)"),
    ("entropy", "token entropy"),
    ("clip_ratio/region_mean", "clipped token share"),
    ("grad_norm", "grad norm"),
    ("time/step", "seconds per step"),
]


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"{run_dir} has no metrics.jsonl; is it a run directory (run.output_dir)?")
    rows = read_metrics(path)
    out = Path(out_dir) if out_dir else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    panels = [(k, t) for k, t in PANELS if any(r.get(k) is not None for r in rows)]
    if not panels:
        raise DataError(f"{path} holds no plottable metrics yet")
    cols = 2
    rows_n = (len(panels) + 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(11, 3 * rows_n), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and "step" in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if key.startswith("eval/") else None,
                markersize=4, linewidth=1.2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    target = out / "learning_curves.png"
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return [target]
