"""Generate docs/configuration.md from the config dataclasses' `#:` field comments.

Each field is documented once, in the code; this keeps the reference true by
construction. `python -m graft_fed.configdoc > docs/configuration.md`; a test fails
when the committed file is stale.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from typing import Any

_FIELD = re.compile(r"^\s+(\w+)\s*:\s*([^=]+?)(?:\s*=\s*(.+))?$")


def field_comments(cls: type) -> dict[str, str]:
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        m = _FIELD.match(line)
        if m and pending:
            comments[m.group(1)] = " ".join(pending)
        if not stripped.startswith("#"):
            pending = []
    return comments


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _fmt(value: Any) -> str:
    if dataclasses.is_dataclass(value):
        return "(section)"
    if isinstance(value, str):
        return f'`"{value}"`'
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return "`[" + ", ".join(map(str, value)) + "]`"
    return f"`{value}`"


def _type_name(tp: Any) -> str:
    text = getattr(tp, "__name__", None) if not typing.get_args(tp) else None
    if text is None:
        text = re.sub(r"\b[\w.]+\.(\w+)", r"\1", str(tp).replace("typing.", ""))
    return text.replace("|", "\\|")


def section_markdown(cls: type, prefix: str, out: list[str], skip: frozenset[str] = frozenset()) -> None:
    hints = typing.get_type_hints(cls)
    doc = inspect.getdoc(cls) or ""
    if doc.startswith(f"{cls.__name__}("):  # dataclass's generated signature, not a description
        doc = ""
    out.append(f"## `{prefix or 'top level'}`\n")
    if doc:
        out.append(doc.split("\n\n")[0] + "\n")
    comments = field_comments(cls)
    nested = []
    rows = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        tp = hints[f.name]
        base = typing.get_args(tp)[0] if typing.get_origin(tp) in (typing.Union, tuple) else tp
        if dataclasses.is_dataclass(base):
            nested.append((base, f"{prefix}.{f.name}" if prefix else f.name))
            kind = "list of sections" if typing.get_origin(tp) is tuple else "section"
            rows.append(f"| `{f.name}` | {kind} | | see `{prefix + '.' if prefix else ''}{f.name}` below |")
            continue
        rows.append(f"| `{f.name}` | {_type_name(tp)} | {_fmt(_default(f))} | {comments.get(f.name, '')} |")
    out.append("| key | type | default | meaning |\n|---|---|---|---|")
    out.extend(rows)
    out.append("")
    for sub, name in nested:
        section_markdown(sub, name, out)


def render() -> str:
    from graft_fed.trainer.config import TrainConfig

    out = ["# Configuration reference", "",
           "Generated from the config dataclasses by `python -m graft_fed.configdoc`; do not edit by hand.",
           "Every run reads one YAML file whose sections are below. Unknown keys are errors; so are values",
           "out of range and impossible combinations, with a message saying how to fix them. `train`,",
           "`cotrain`, `node`, `broker` and `sim` override any field on the command line with",
           "`--set section.key=value` (repeatable; the value is read as YAML, nothing after the `=` is",
           "the empty string, e.g. `--set http=''`, and `key=null` is null); `experiment` takes its",
           "config as written.", ""]
    section_markdown(TrainConfig, "", out)
    from graft_fed.experiment import ExperimentConfig
    from graft_fed.graft.cotrain import CotrainConfig

    out += ["# Co-training (`graft-fed cotrain`)", "",
            "A cotrain config has every section above, shared by all members, plus these keys.", ""]
    section_markdown(CotrainConfig, "cotrain", out, skip=frozenset(f.name for f in dataclasses.fields(TrainConfig)))
    out += ["# Experiment (`graft-fed experiment`)", "",
            "`base` is a run config as above (without model and output_dir); a `quick` mapping of the same",
            "keys is applied with `--quick`.", ""]
    section_markdown(ExperimentConfig, "experiment", out)
    from graft_fed.broker.config import BrokerConfig
    from graft_fed.node.node import FederationSection
    from graft_fed.sim import SimConfig

    out += ["# Node (`graft-fed node`)", "",
            "A node config has every section of a run config, plus `federation`.", ""]
    section_markdown(FederationSection, "federation", out)
    out += ["# Broker (`graft-fed broker`)", ""]
    section_markdown(BrokerConfig, "broker", out)
    out += ["# One-machine federation (`graft-fed sim`)", "",
            "`broker` is a broker config (listen, http and db are chosen by the simulator); `base` a node "
            "config without model, output_dir and the broker address.", ""]
    section_markdown(SimConfig, "sim", out)  # its nodes' section follows it
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
