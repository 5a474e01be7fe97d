"""Which prompts a run trains or evaluates on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from graft_fed.configbase import require
from graft_fed.data.loaders import (ANSWER_FORMATS, BENCHMARKS, load_benchmark, load_hf_dataset,
                                    load_prompt_file)
from graft_fed.data.prompts import Prompt
from graft_fed.errors import ConfigError

EMBEDDED_PREFIX = "embedded:"
HF_PREFIX = "hf:"
FILE_SUFFIXES = (".jsonl", ".parquet")


def source_kind(source: str) -> str:
    """'embedded', 'hf', 'benchmark' or 'file'."""
    if source.startswith(EMBEDDED_PREFIX):
        return "embedded"
    if source.startswith(HF_PREFIX):
        return "hf"
    if source in BENCHMARKS:
        return "benchmark"
    return "file"


@dataclass(frozen=True)
class DataConfig:
    """The prompt source of a run."""

    #: Where prompts come from: an embedded task id ("embedded:arith-v1"), a benchmark
    #: name (math500, aime24, aime25, amc23, minerva, olympiadbench, gsm8k; files under
    #: the benchmarks directory), a local .jsonl/.parquet path, or "hf:<hub_id>" /
    #: "hf:<hub_id>:<config_name>" (needs the optional `datasets` package).
    source: str = "embedded:arith-v1"
    #: Split to load: used by embedded and hf sources; a file or benchmark IS one split.
    split: str = "train"
    #: Embedded task families (or sub-families such as add_carry) to include (embedded only); empty means all.
    families: tuple[str, ...] = ()
    #: Prompts per family (embedded only); None means the task's default for the split.
    per_family: int | None = None
    #: Field of a file/hf row holding the problem text.
    problem_field: str = "problem"
    #: Field of a file/hf row holding the gold final answer.
    answer_field: str = "answer"
    #: Field of a file/hf row holding the source's own row id (kept in meta["source_id"];
    #: the prompt id is always the stable hash). None: not kept.
    id_field: str | None = None
    #: Keep only the first N prompts (in source order) after loading; None keeps all.
    max_prompts: int | None = None
    #: How a file/hf row's answer field holds the gold answer: "plain" (the answer itself),
    #: "boxed" (a worked solution whose last \boxed{} is the answer, as MATH's `solution`)
    #: or "gsm8k" (the text after '####').
    answer_format: str = "plain"
    #: Dataset id that prompt ids hash (file/hf only); null = the file name without its
    #: suffix, or the hub id. Nodes that exchange groups must use the same id for the same
    #: data, however each of them loads it.
    dataset_id: str | None = None

    def __post_init__(self) -> None:
        require(isinstance(self.source, str) and self.source.strip() != "",
                "data.source must name a source: an embedded task id like 'embedded:arith-v1', a benchmark "
                f"name ({', '.join(BENCHMARKS)}), a .jsonl/.parquet path or 'hf:<hub_id>'")
        kind = source_kind(self.source)
        if kind == "file":
            require(self.source.endswith(FILE_SUFFIXES),
                    f"data.source {self.source!r} is not an embedded task ('embedded:...'), a benchmark "
                    f"({', '.join(BENCHMARKS)}), 'hf:<hub_id>', or a path ending in .jsonl or .parquet")
        if kind == "hf":
            require(self.source[len(HF_PREFIX):].strip(":") != "",
                    "data.source 'hf:' needs a hub id, e.g. 'hf:HuggingFaceH4/MATH-500'")
        require(isinstance(self.split, str) and self.split != "", "data.split must be a non-empty string")
        require(isinstance(self.families, tuple) and all(isinstance(f, str) and f for f in self.families),
                f"data.families must be a list of family names, got {self.families!r}")
        require(self.per_family is None or (isinstance(self.per_family, int) and not isinstance(self.per_family, bool)
                                            and self.per_family >= 1),
                f"data.per_family must be a positive integer or null, got {self.per_family!r}")
        if kind != "embedded":
            require(not self.families and self.per_family is None,
                    f"data.families and data.per_family only apply to embedded sources; remove them for "
                    f"{self.source!r} (or use max_prompts)")
        for name in ("problem_field", "answer_field"):
            value = getattr(self, name)
            require(isinstance(value, str) and value != "", f"data.{name} must be a non-empty field name")
        require(self.id_field is None or (isinstance(self.id_field, str) and self.id_field != ""),
                "data.id_field must be a field name or null")
        require(self.max_prompts is None or (isinstance(self.max_prompts, int) and not isinstance(self.max_prompts, bool)
                                             and self.max_prompts >= 1),
                f"data.max_prompts must be a positive integer or null, got {self.max_prompts!r}")
        require(self.answer_format in ANSWER_FORMATS,
                f"data.answer_format must be one of {', '.join(ANSWER_FORMATS)}, got {self.answer_format!r}")
        require(self.dataset_id is None or (isinstance(self.dataset_id, str) and self.dataset_id.strip() != ""),
                "data.dataset_id must be a non-empty string or null")
        if kind in ("embedded", "benchmark"):
            require(self.answer_format == "plain" and self.dataset_id is None,
                    f"data.answer_format and data.dataset_id only apply to files and hf sources; remove them for "
                    f"{self.source!r}")


def load_prompts(cfg: DataConfig, benchmarks_root: str | Path | None = None) -> list[Prompt]:
    """The prompts `cfg` names, in source order, capped at `cfg.max_prompts`.

    `benchmarks_root` is the benchmarks directory (else $GRAFT_FED_BENCHMARKS_DIR).
    """
    kind = source_kind(cfg.source)
    if kind == "embedded":
        from graft_fed.data import task

        if cfg.source != task.DATASET_ID:
            raise ConfigError(f"unknown embedded task {cfg.source!r}; the embedded task is {task.DATASET_ID!r}")
        prompts = list(task.embedded_split(cfg.split, families=cfg.families or None,
                                           per_family=cfg.per_family, seed=0))
    elif kind == "benchmark":
        prompts = load_benchmark(cfg.source, root=benchmarks_root)
    elif kind == "hf":
        hub_id, _, config_name = cfg.source[len(HF_PREFIX):].partition(":")
        prompts = load_hf_dataset(hub_id, cfg.split, config_name=config_name or None, dataset_id=cfg.dataset_id,
                                  problem_field=cfg.problem_field, answer_field=cfg.answer_field,
                                  id_field=cfg.id_field, answer_transform=ANSWER_FORMATS[cfg.answer_format])
    else:
        prompts = load_prompt_file(cfg.source, dataset_id=cfg.dataset_id, problem_field=cfg.problem_field,
                                   answer_field=cfg.answer_field, id_field=cfg.id_field,
                                   answer_transform=ANSWER_FORMATS[cfg.answer_format])
    return prompts[: cfg.max_prompts] if cfg.max_prompts is not None else prompts
