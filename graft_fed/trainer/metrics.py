"""Per-step metrics: one JSONL row per step, optionally mirrored to TensorBoard.

Names follow TRL where TRL has the metric (`reward`, `reward_std`,
`frac_reward_zero_std`, `completions/mean_length`, `completions/clipped_ratio`,
`clip_ratio/low_mean`, `clip_ratio/high_mean`, `entropy`), so dashboards carry over.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

from graft_fed.errors import ConfigError


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; a null says "not defined this step"
    return value


class MetricsWriter:
    def __init__(self, run_dir: str | Path, tensorboard: bool = False, resume_step: int | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            self._truncate_after(resume_step)
        self._fh = self.path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ConfigError("run.tensorboard is true but TensorBoard is not installed: "
                                  "pip install 'graft-fed[tensorboard]'") from exc
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def _truncate_after(self, step: int) -> None:
        """Take out the rows written after the checkpoint a run resumes from (by a run that
        crashed after it, or a line of steps abandoned by resuming from an earlier checkpoint),
        so the resumed run's log has exactly one row per step. The rows taken out are appended
        to `metrics.dropped.jsonl` beside it, not lost."""
        kept, dropped = [], []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                (kept if json.loads(line).get("step", 0) <= step else dropped).append(line)
        if not dropped:
            return
        with self.path.with_name("metrics.dropped.jsonl").open("a", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in dropped))
            fh.flush()
            os.fsync(fh.fileno())
        tmp = self.path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def write(self, row: Mapping[str, Any]) -> None:
        self._fh.write(json.dumps({k: _clean(v) for k, v in row.items()}, sort_keys=False) + "\n")
        self._fh.flush()
        if self._tb is not None:
            step = int(row.get("step", 0))
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step" and math.isfinite(float(value)):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()


class NullMetrics:
    """The metrics writer of a process that writes no files (every torchrun rank but 0)."""

    def write(self, row: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n} is not a JSON object: {exc}") from None
    return rows
