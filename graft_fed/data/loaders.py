"""Loading prompts from local JSONL/Parquet files, the Hugging Face hub and benchmark files.

Every loader returns `Prompt`s whose `problem` is BARE: the paper's reasoning suffix,
which many published files already append, is stripped, because the receiving model's
template adds it (templates.py). Stripping also keeps the stable prompt id the same
whether a file carries the suffix or not. Ids are hashes of (dataset id, problem), so
they do not depend on row order; a source row id (`id_field`) is kept in
`meta["source_id"]`.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from graft_fed.data.prompts import Prompt
from graft_fed.data.templates import PAPER_SUFFIX
from graft_fed.errors import DataError

BENCHMARKS_ENV = "GRAFT_FED_BENCHMARKS_DIR"
AnswerTransform = Callable[[Any], Any]


def strip_paper_suffix(problem: str) -> str:
    """`problem` without trailing paper suffixes (and the blank space before them)."""
    body = problem.rstrip()
    while body.endswith(PAPER_SUFFIX):
        body = body[: -len(PAPER_SUFFIX)].rstrip()
    return body


_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")


def gsm8k_final_answer(solution: Any) -> str:
    """The final answer of a GSM8K solution: the text after its last '####', thousands commas removed.

    '1,000' is removed to '1000' because math-verify would read '1,000' as a tuple.
    """
    if not isinstance(solution, str) or "####" not in solution:
        raise ValueError("a GSM8K answer must be a string whose final answer follows '####'")
    final = solution.rsplit("####", 1)[1].strip()
    if _THOUSANDS.fullmatch(final):
        final = final.replace(",", "")
    if not final:
        raise ValueError("nothing follows '####' in this GSM8K answer")
    return final


def boxed_solution_answer(solution: Any) -> str:
    """The final answer of a worked solution: the content of its last \\boxed{} (MATH's
    `solution` field; nested braces kept)."""
    from graft_fed.rewards.boxed import last_boxed

    if not isinstance(solution, str):
        raise ValueError(f"a worked solution must be a string, got {type(solution).__name__}")
    answer = last_boxed(solution)
    if answer is None or not answer.strip():
        raise ValueError("the solution has no complete \\boxed{...} answer")
    return answer.strip()


#: data.answer_format -> how to turn the answer field into the gold answer (None: as it is).
ANSWER_FORMATS: dict[str, AnswerTransform | None] = {
    "plain": None, "boxed": boxed_solution_answer, "gsm8k": gsm8k_final_answer}


def _answer_text(value: Any) -> str:
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"the answer must be a string or a number, got {type(value).__name__}; "
                         "pass answer_transform to turn it into one")
    return str(value)


def prompts_from_rows(rows: Iterable[tuple[str, Any]], dataset_id: str, problem_field: str = "problem",
                      answer_field: str = "answer", id_field: str | None = None,
                      answer_transform: AnswerTransform | None = None, source: str = "") -> list[Prompt]:
    """Prompts from (where, row) pairs; `where` names the row in error messages (file:line)."""
    prompts: list[Prompt] = []
    seen: dict[str, tuple[str, str]] = {}
    duplicates: list[str] = []
    conflicts: list[str] = []
    for where, row in rows:
        if not isinstance(row, Mapping):
            raise DataError(f"{where}: expected an object with fields {problem_field!r} and {answer_field!r}, "
                            f"got {type(row).__name__}")
        for name in (problem_field, answer_field) + ((id_field,) if id_field else ()):
            if name not in row or row[name] is None:
                raise DataError(f"{where}: missing field {name!r} (row has: {', '.join(map(str, row)) or 'nothing'}); "
                                "pass problem_field/answer_field/id_field to map other names")
        problem = row[problem_field]
        if not isinstance(problem, str) or not problem.strip():
            raise DataError(f"{where}: field {problem_field!r} must be a non-empty string, got {problem!r:.80}")
        try:
            raw = answer_transform(row[answer_field]) if answer_transform else row[answer_field]
            answer = _answer_text(raw)
        except ValueError as exc:
            raise DataError(f"{where}: bad field {answer_field!r}: {exc}") from None
        if not answer:
            raise DataError(f"{where}: field {answer_field!r} is empty")
        meta = {"source_id": row[id_field]} if id_field else {}
        # a benchmark's own breakdown (MATH: level, subject), reported per value by `eval`
        meta.update({key: row[key] for key in ("level", "subject") if isinstance(row.get(key), (str, int))})
        prompt = Prompt.make(dataset_id, strip_paper_suffix(problem), answer, **meta)
        if prompt.id in seen:
            first_where, first_answer = seen[prompt.id]
            (conflicts if first_answer != answer else duplicates).append(f"{where} (same as {first_where})")
            continue
        seen[prompt.id] = (where, answer)
        prompts.append(prompt)
    if duplicates or conflicts:
        dropped = duplicates + conflicts
        detail = f"; {len(conflicts)} of them with a DIFFERENT answer, first kept" if conflicts else ""
        warnings.warn(f"{source or dataset_id}: dropped {len(dropped)} duplicate problem(s){detail}: "
                      f"{', '.join(dropped[:5])}{' ...' if len(dropped) > 5 else ''}", stacklevel=3)
    if not prompts:
        raise DataError(f"{source or dataset_id}: no prompts (the source has no rows)")
    return prompts


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow, which is not installed: "
                        "pip install 'graft-fed[data]' (or pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several unrelated types for a bad file
        raise DataError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    for index, row in enumerate(table.to_pylist(), 1):
        yield f"{path}:row {index}", row


def dataset_id_for(path: str | Path) -> str:
    """The default dataset id of a file: its name without the .jsonl/.parquet suffix."""
    name = Path(path).name
    for suffix in (".jsonl", ".parquet"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def load_prompt_file(path: str | Path, dataset_id: str | None = None, problem_field: str = "problem",
                     answer_field: str = "answer", id_field: str | None = None,
                     answer_transform: AnswerTransform | None = None) -> list[Prompt]:
    """Prompts from a .jsonl (one object per line) or .parquet file, in file order.

    Duplicate problems are dropped with a warning (the first is kept); a malformed row
    raises DataError naming the file and line (or Parquet row).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"prompt file {path} does not exist")
    if path.suffix == ".jsonl":
        rows = _jsonl_rows(path)
    elif path.suffix == ".parquet":
        rows = _parquet_rows(path)
    else:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl or .parquet")
    return prompts_from_rows(rows, dataset_id or dataset_id_for(path), problem_field, answer_field,
                             id_field, answer_transform, source=str(path))


def load_hf_dataset(hub_id: str, split: str, config_name: str | None = None, dataset_id: str | None = None,
                    problem_field: str = "problem", answer_field: str = "answer", id_field: str | None = None,
                    answer_transform: AnswerTransform | None = None, revision: str | None = None) -> list[Prompt]:
    """Prompts from a Hugging Face hub dataset (needs the optional `datasets` package).

    The dataset id defaults to `hub_id`, or `hub_id/config_name` with a config.
    """
    try:
        import datasets
    except ImportError:
        raise DataError(f"loading hf:{hub_id} needs the 'datasets' package, which is not installed: "
                        "pip install 'graft-fed[data]' (or use a local .jsonl/.parquet file)") from None
    try:
        ds = datasets.load_dataset(hub_id, config_name, split=split, revision=revision)
    except Exception as exc:  # network, auth, unknown split: all surface as one clear DataError
        raise DataError(f"cannot load hub dataset {hub_id!r} (config {config_name!r}, split {split!r}): "
                        f"{type(exc).__name__}: {exc}") from None
    source = f"hf:{hub_id}[{split}]"
    rows = ((f"{source} row {i}", row) for i, row in enumerate(ds, 1))
    return prompts_from_rows(rows, dataset_id or (f"{hub_id}/{config_name}" if config_name else hub_id),
                             problem_field, answer_field, id_field, answer_transform, source=source)


@dataclass(frozen=True)
class Benchmark:
    """Where a benchmark's file is (relative to the benchmarks directory) and how to read it."""

    filename: str
    problem_field: str = "problem"
    answer_field: str = "answer"
    answer_transform: AnswerTransform | None = None


#: Evaluation benchmarks by name; the name is also the dataset id of their prompts.
BENCHMARKS: dict[str, Benchmark] = {
    "math500": Benchmark("math500.jsonl"),
    "aime24": Benchmark("aime24.jsonl"),
    "aime25": Benchmark("aime25.jsonl"),
    "amc23": Benchmark("amc2023.jsonl"),
    "minerva": Benchmark("minervamath.jsonl"),
    "olympiadbench": Benchmark("olympiadbench.jsonl"),
    "gsm8k": Benchmark("gsm8k_test.jsonl", problem_field="question", answer_transform=gsm8k_final_answer),
}


def benchmarks_root(root: str | Path | None = None) -> Path:
    """The benchmarks directory: `root`, else $GRAFT_FED_BENCHMARKS_DIR."""
    chosen = root if root is not None else os.environ.get(BENCHMARKS_ENV)
    if not chosen:
        raise DataError(f"no benchmarks directory: pass root=... (--benchmarks-dir) or set {BENCHMARKS_ENV} "
                        f"to the directory holding {', '.join(b.filename for b in BENCHMARKS.values())}")
    path = Path(chosen)
    if not path.is_dir():
        raise DataError(f"benchmarks directory {path} does not exist (from "
                        f"{'the root argument' if root is not None else '$' + BENCHMARKS_ENV})")
    return path


def load_benchmark(name_or_path: str | Path, root: str | Path | None = None) -> list[Prompt]:
    """A benchmark by registry name (file under `root`), or a benchmark file by path.

    A path whose file name is a registry file name (e.g. gsm8k_test.jsonl) is read with
    that benchmark's field mapping and dataset id; any other path with the defaults.
    """
    name = str(name_or_path)
    if name in BENCHMARKS:
        spec = BENCHMARKS[name]
        path = benchmarks_root(root) / spec.filename
        if not path.is_file():
            raise DataError(f"benchmark {name!r}: {path} does not exist; the benchmarks directory must hold "
                            f"{spec.filename}")
        dataset_id = name
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise DataError(f"{name!r} is neither a benchmark name ({', '.join(BENCHMARKS)}) nor an existing file")
        by_file = {b.filename: (n, b) for n, b in BENCHMARKS.items()}
        dataset_id, spec = by_file.get(path.name, (dataset_id_for(path), Benchmark(path.name)))
    return load_prompt_file(path, dataset_id=dataset_id, problem_field=spec.problem_field,
                            answer_field=spec.answer_field, answer_transform=spec.answer_transform)
