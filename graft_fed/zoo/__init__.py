"""The embedded zoo: tiny causal LMs, shipped with the package, that differ the way real
models differ (architecture, tokenizer, size, prompt template) and have complementary
strengths on the embedded task (graft_fed.data.task).  docs/zoo.md has the measurements;
graft_fed.zoo.build rebuilds them from a seed.
"""

from __future__ import annotations

from pathlib import Path

from graft_fed.errors import ConfigError

ZOO_NAMES: tuple[str, ...] = ("tiny-llama-char", "tiny-gpt2-bpe", "tiny-qwen3-unigram")
ZOO_PREFIX = "zoo:"


def zoo_dir() -> Path:
    """The folder holding the shipped models, one sub-folder per name."""
    return Path(__file__).resolve().parent / "models"


def resolve_model_path(spec: str) -> str:
    """`zoo:<name>` -> the shipped model's folder; anything else is returned unchanged
    (a filesystem path, or a hub id that transformers may resolve)."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"model spec must be a non-empty string, got {spec!r}")
    if not spec.startswith(ZOO_PREFIX):
        return spec
    name = spec[len(ZOO_PREFIX):]
    if name not in ZOO_NAMES:
        raise ConfigError(f"unknown zoo model {name!r}; the zoo has: "
                          f"{', '.join(ZOO_PREFIX + n for n in ZOO_NAMES)}")
    path = zoo_dir() / name
    if not (path / "config.json").is_file():
        raise ConfigError(f"zoo model {name!r} is not built at {path}; run `graft-fed zoo build`")
    return str(path)


__all__ = ["ZOO_NAMES", "zoo_dir", "resolve_model_path"]
