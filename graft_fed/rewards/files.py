"""Scoring a responses file against a references file (`graft-fed score`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

from graft_fed.errors import DataError
from graft_fed.rewards.config import VerifierConfig
from graft_fed.rewards.verifier import build_verifier

MISSING_REFERENCE = "missing_reference"


def _rows(path: Path, kind: str, value_field: str) -> Iterator[tuple[int, Any, str]]:
    """(line number, id, value) per non-blank line of a JSONL file of {id, <value_field>}."""
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise DataError(f"cannot read {kind} file {path}: {exc.strerror}") from None
    with handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object {{\"id\": ..., \"{value_field}\": ...}}, "
                                f"got {type(row).__name__}")
            for key in ("id", value_field):
                if key not in row:
                    raise DataError(f"{where}: missing key {key!r}; each {kind} line needs "
                                    f"\"id\" and \"{value_field}\" (has: {', '.join(sorted(row)) or 'nothing'})")
            row_id = row["id"]
            if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
                raise DataError(f"{where}: \"id\" must be a string or an integer, got {row_id!r}")
            value = row[value_field]
            if kind == "references" and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = str(value)
            if not isinstance(value, str):
                raise DataError(f"{where}: \"{value_field}\" must be a string, got {type(value).__name__}")
            yield lineno, row_id, value


def score_files(responses_path: str | Path, references_path: str | Path,
                out_path: str | Path | None = None, cfg: VerifierConfig | None = None) -> dict[str, Any]:
    """Score every response against the reference answer with the same id.

    Responses may repeat an id (several samples per prompt); reference ids must be
    unique. A response whose id has no reference scores 0 with status
    "missing_reference". Writes one `{id, reward, status}` line per response, in input
    order, to `out_path` when given. Returns the summary.
    """
    cfg = cfg or VerifierConfig()
    references_path, responses_path = Path(references_path), Path(responses_path)
    answers: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for lineno, row_id, answer in _rows(references_path, "references", "answer"):
        key = str(row_id)
        if key in answers:
            raise DataError(f"{references_path}:{lineno}: duplicate id {row_id!r} (first on line "
                            f"{first_line[key]}); reference ids must be unique")
        answers[key], first_line[key] = answer, lineno
    responses = list(_rows(responses_path, "responses", "response"))

    known = [i for i, (_, row_id, _) in enumerate(responses) if str(row_id) in answers]
    rewards = [0.0] * len(responses)
    statuses = [MISSING_REFERENCE] * len(responses)
    with build_verifier(cfg) as verifier:
        result = verifier.score([responses[i][2] for i in known], [answers[str(responses[i][1])] for i in known])
        version = verifier.version
    for i, reward, status in zip(known, result.rewards, result.statuses):
        rewards[i], statuses[i] = reward, status

    if out_path is not None:
        out_path = Path(out_path)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with out_path.open("w", encoding="utf-8") as out:
            for (_, row_id, _), reward, status in zip(responses, rewards, statuses):
                out.write(json.dumps({"id": row_id, "reward": reward, "status": status}) + "\n")

    answered = {str(row_id) for _, row_id, _ in responses}
    return {
        "n": len(responses),
        "scored": len(known),
        "mean_reward": math.fsum(rewards) / len(rewards) if rewards else 0.0,
        "timeouts": result.timeouts,
        "errors": result.errors,
        "fast_path": result.fast_path,
        "no_boxed": result.no_boxed,
        "missing_references": len(responses) - len(known),
        "missing_responses": sum(1 for key in answers if key not in answered),
        "verifier": cfg.name,
        "verifier_version": version,
        "out": str(out_path) if out_path is not None else None,
    }
