"""Every command in README.md, docs/ and bench/ works from a fresh clone (issue 14, item 6).

1. Every `graft-fed ...` command written in README.md, docs/**/*.md and bench/ (code blocks,
   inline code, and the usage lines in bench scripts' and configs' comments) names a real
   subcommand and only real flags of `graft_fed.cli.build_parser()`, and every complete one
   parses. Nothing is run.
2. A CI-size smoke run of each non-broker benchmark of bench/README.md, on CPU with the
   shipped zoo models and nothing downloaded, checking what it prints or writes, not only
   its exit code. bench/gpu_check.py is smoke-run by tests/test_gpu_check.py (--tiny) and
   the broker benchmarks by tests/federation/test_load_bench.py; bench/step_time's TRL side
   needs its own venv (setup_venv.sh, checked by tests/test_packaging.py), so only its
   graft-fed side, report.py and the flags run.sh passes run here.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from graft_fed.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
FIXTURE_BENCHMARKS = ROOT / "tests" / "fixtures" / "benchmarks"


# --------------------------------------------------------------------------- documented commands

def _fenced_lines(path: Path):
    """(line number, text) of each logical line inside ``` fences; `\\` continuations joined."""
    lines = path.read_text(encoding="utf-8").splitlines()
    inside, i = False, 0
    while i < len(lines):
        text = lines[i].strip()
        start = i + 1
        if text.startswith("```"):
            inside = not inside
        elif inside:
            while text.endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text[:-1] + " " + lines[i].strip()
            yield start, text
        i += 1


def _outside_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def documented_commands(root: Path = ROOT) -> list[tuple[str, str, bool]]:
    """(where, command line, complete) for every documented `graft-fed` command.

    complete: written to be run as it is (code blocks, usage comments), so it must parse;
    inline code in prose (`graft-fed broker nodes add`) may name a command without its
    required arguments, so only its subcommands and flags are checked."""
    found: list[tuple[str, str, bool]] = []
    bench = root / "bench"
    md = [root / "README.md", *sorted((root / "docs").rglob("*.md")), *sorted(bench.rglob("README.md"))]
    for path in md:
        rel = path.relative_to(root)
        for n, text in _fenced_lines(path):
            if "graft-fed" in text:
                found.append((f"{rel}:{n}", text, True))
        for m in re.finditer(r"(?<!`)`(graft-fed [^`\n]+)`", _outside_fences(path.read_text(encoding="utf-8"))):
            found.append((f"{rel} (inline)", m.group(1), False))
    # usage lines in bench scripts' docstrings and comments, and in the bench configs' headers
    for path in sorted(p for p in bench.rglob("*") if p.suffix in (".py", ".sh", ".yaml")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            text = line.strip().lstrip("#").strip()
            # `graft-fed experiment --config X   (one pair, one seed, minutes)`: a remark, not arguments
            text = re.sub(r"\s+\([^()]*\)$", "", text)
            if text.startswith("graft-fed "):
                found.append((f"{path.relative_to(root)}:{n}", text, True))
    return found


#: A placeholder the docs write in capitals (FILE, DIR, N, RUN, S, A+B, NODE, ...) or in angle
#: brackets (<name>): replaced by a value every option type here accepts.
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_+\-]*$")
_SEPARATORS = {"|", "||", "&&", ";", "&"}


def _expand_alternatives(text: str) -> list[str]:
    """`graft-fed store list|export|import` (no spaces: a choice, not a pipe) -> one line each."""
    m = re.search(r"\b[\w-]+(?:\|[\w-]+)+\b", text)
    if not m:
        return [text]
    return [out for alt in m.group().split("|")
            for out in _expand_alternatives(text[:m.start()] + alt + text[m.end():])]


def graft_fed_invocations(text: str) -> list[list[str]]:
    """The argument lists of the `graft-fed` invocations in one shell line."""
    text = re.sub(r"(^|\s)#.*$", "", text)            # shell comment
    text = re.sub(r"^\$\s+", "", text)                 # `$ ` prompt
    text = text.replace("[", " ").replace("]", " ")    # [--optional ARG]
    text = re.sub(r"(?<!\S)<[^<>\s]+>(?!\S)", "VALUE", text)  # a <name> placeholder: filled() fills it
    text = re.sub(r"<[^<>\s]+>", "x", text)            # zoo:<name>
    out = []
    for variant in _expand_alternatives(text):
        lex = shlex.shlex(variant, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        lex.commenters = ""
        try:
            tokens = list(lex)
        except ValueError:  # not shell: prose or a program's output quoted in a code block
            tokens = variant.split()
        segments, seg = [], []
        for tok in tokens:
            if tok in _SEPARATORS:
                segments.append(seg)
                seg = []
            else:
                seg.append(tok)
        segments.append(seg)
        for seg in segments:
            for i, tok in enumerate(seg):
                if os.path.basename(tok) != "graft-fed":
                    continue
                # the command word of the segment, or run inside a container:
                # `docker compose ... exec SERVICE graft-fed`, `kubectl exec POD -- graft-fed`
                prefix = seg[:i]
                if not (all(re.match(r"^\w+=", t) for t in prefix) or prefix[-1:] == ["--"]
                        or prefix[-2:-1] == ["exec"]):
                    continue  # e.g. `kubectl -n graft-fed ...`: a namespace, not the command
                args = seg[i + 1:]
                # a command's printed output, quoted in a code block: `graft-fed node: error: ...`
                if args and args[0].endswith(":"):
                    continue
                args = [a for a in args if a != "..."]
                out.append(filled(args))
    return out


@functools.lru_cache(maxsize=1)
def cli_parser():
    """The real parser, built once (parsing does not change it)."""
    return build_parser()


def filled(args: list[str]) -> list[str]:
    """`args` with each placeholder (FILE, N, NAME, $n, ...) replaced by a value its option
    takes: the first of the option's choices, else "1" (a valid int, float or string)."""
    parser, action, out = cli_parser(), None, []
    for tok in args:
        if _PLACEHOLDER.match(tok) or tok.startswith("$"):
            choices = getattr(action, "choices", None)
            tok = next(iter(choices)) if choices else "1"
        out.append(tok)
        parser = _subparsers(parser).get(tok, parser)
        action = parser._option_string_actions.get(tok.split("=", 1)[0])
    return out


def _subparsers(parser) -> dict:
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def unknown_words(args: list[str]) -> list[str]:
    """Subcommands and flags of `args` the parser does not define, spelt exactly (argparse
    would accept an abbreviation; the docs should not rely on one)."""
    parser = cli_parser()
    options = set(parser._option_string_actions)
    bad, expect_sub = [], True
    path = []
    for tok in args:
        subs = _subparsers(parser)
        if tok.startswith("-") and tok != "-" and not re.match(r"^-\d", tok):
            if tok.split("=", 1)[0] not in options:
                bad.append(f"{tok.split('=', 1)[0]} (not an option of graft-fed {' '.join(path)})".replace(" )", ")"))
            continue
        if subs and expect_sub:
            if tok in subs:
                parser = subs[tok]
                path.append(tok)
                options |= set(parser._option_string_actions)
                continue
            if not path:
                bad.append(f"{tok} (not a graft-fed subcommand)")
                break
            # `graft-fed broker --config X`: broker's own arguments, its sub-subcommand is optional
            expect_sub = False
    if not path and not bad:
        bad.append("(no subcommand)")
    return bad


def parse_error(args: list[str]) -> str | None:
    """argparse's error for `graft-fed ARGS`, or None when it parses (nothing is run)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            cli_parser().parse_args(args)
    except SystemExit as exc:
        if exc.code not in (0, None):
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}"
    return None


def test_the_extraction_finds_the_documented_commands():
    """Guards the extractor itself: it must see what the docs obviously contain."""
    found = documented_commands()
    cmds = [" ".join(args) for _, text, _ in found for args in graft_fed_invocations(text)]
    assert len(cmds) >= 40, cmds
    for expected in ("sim --nodes 3 --config configs/sim-zoo.yaml", "zoo build", "zoo measure",
                     "status --broker 127.0.0.1:50551 --tls-ca /etc/graft-fed/certs/ca.pem",
                     "broker nodes revoke --allowlist", "store export", "store import",
                     "experiment --config bench/paper_miniature.yaml --quick"):
        assert any(c.startswith(expected) for c in cmds), expected
    assert graft_fed_invocations("kubectl -n graft-fed logs -f job/graft-fed-node-x") == []
    assert graft_fed_invocations("graft-fed node: error: the broker refused") == []
    assert graft_fed_invocations("graft-fed zoo build | graft-fed zoo measure  # both") == [
        ["zoo", "build"], ["zoo", "measure"]]
    assert graft_fed_invocations("graft-fed score --responses FILE [--out <path>]") == [
        ["score", "--responses", "1", "--out", "1"]]
    assert filled(["zoo", "build", "--only", "NAME", "--threads", "N"]) == [
        "zoo", "build", "--only", "tiny-llama-char", "--threads", "1"]
    # and the checks catch what they are for
    assert unknown_words(["trian", "--config", "x"]) == ["trian (not a graft-fed subcommand)"]
    assert unknown_words(["train", "--confg", "x"])[0].startswith("--confg")
    assert unknown_words(["eval", "--model", "m", "--bench", "b"])[0].startswith("--bench")  # no abbreviations
    assert parse_error(["eval", "--model", "m"]) is not None  # --benchmark is required


def command_problems(root: Path = ROOT) -> list[str]:
    problems = []
    for where, text, complete in documented_commands(root):
        for args in graft_fed_invocations(text):
            bad = unknown_words(args)
            if bad:
                problems.append(f"{where}: `graft-fed {' '.join(args)}`: {', '.join(bad)}")
            elif complete and (err := parse_error(args)):
                problems.append(f"{where}: `graft-fed {' '.join(args)}`: {err}")
    return problems


def test_a_wrong_command_in_the_docs_is_named_with_its_file_and_line(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("Run\n\n```bash\ngraft-fed train --config configs/tiny-grpo.yaml\n```\n"
                                        "or `graft-fed trian`.\n")
    (tmp_path / "docs" / "usage.md").write_text("```\n$ graft-fed eval --model m --benchmark b \\\n"
                                                "    --samples 4\ngraft-fed plot\n```\n")
    assert command_problems(tmp_path) == [
        "README.md (inline): `graft-fed trian`: trian (not a graft-fed subcommand)",
        "docs/usage.md:2: `graft-fed eval --model m --benchmark b --samples 4`: --samples (not an option of "
        "graft-fed eval)",
        "docs/usage.md:4: `graft-fed plot`: graft-fed plot: error: the following arguments are required: RUN",
    ]


def test_every_documented_graft_fed_command_parses():
    problems = command_problems()
    assert not problems, "documented commands the CLI does not accept:\n" + "\n".join(problems)


def test_documented_config_files_exist():
    """`--config PATH` in a documented command names a file of this repository (not one the
    reader writes first, like runs/... or node.yaml in prose)."""
    missing = []
    for where, text, complete in documented_commands():
        for args in graft_fed_invocations(text):
            for flag, value in zip(args, args[1:]):
                if (complete and flag == "--config" and value.split("/")[0] in ("configs", "bench", "nodes", "deploy")
                        and not (ROOT / value).is_file()):
                    missing.append(f"{where}: {value}")
    assert not missing, "documented configs missing from the repository:\n" + "\n".join(missing)


# --------------------------------------------------------------------------- bench smoke runs

def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1",
            "PYTHONPATH": str(ROOT), **extra}


def run(cmd: list[str], timeout: float = 240, **kw) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout, **kw)
    print(f"{' '.join(str(c) for c in cmd)}: {time.monotonic() - t0:.1f} s")
    return res


def ok(res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    return res


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the Markdown tables in `text`, as cells."""
    header = re.compile(r"^\|\s*(model|GPU|receiver)\s*\|")
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and not line.startswith("|---") and not header.match(line)]


@pytest.mark.slow
def test_memory_plan_prints_the_tables_of_docs_scaling():
    out = ok(run([sys.executable, "bench/memory_plan.py"])).stdout
    rows = table_rows(out)
    models = ("Qwen3-1.7B-Base", "SmolLM3-3B-Base", "OctoThinker-3B-Hybrid-Base")
    per_model = [r for r in rows if r[0] in models]
    per_gpu = [r for r in rows if r[0].endswith(("(A100/H100)", "(H200)")) and r[1] in models]
    pairs = [r for r in rows if r[0].endswith(("(A100/H100)", "(H200)")) and " + " in r[1]]
    assert (len(per_model), len(per_gpu), len(pairs)) == (3, 6, 6), out
    assert all(re.fullmatch(r"\d+\.\d+ B", r[1]) for r in per_model), per_model
    # the script is where docs/scaling.md's tables come from: they must still agree
    doc = (ROOT / "docs" / "scaling.md").read_text(encoding="utf-8")
    stale = [line for line in out.splitlines() if line.startswith("| ") and line not in doc]
    assert not stale, "docs/scaling.md is stale against bench/memory_plan.py:\n" + "\n".join(stale)


@pytest.mark.slow
def test_verify_benchmark_golds_scores_every_fixture_gold():
    out = ok(run([sys.executable, "bench/verify_benchmark_golds.py", str(FIXTURE_BENCHMARKS), "--workers", "1",
                  "--show-failures"])).stdout
    files = sorted(p.name for p in FIXTURE_BENCHMARKS.glob("*.jsonl"))
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in files}
    assert sorted(rows) == files, out
    for name, (_, bench, n, ones, timeouts, errors, weak, _secs) in rows.items():
        assert bench != "-", f"{name} is not a known benchmark file"
        assert int(n) > 0 and int(ones) == int(n) and int(timeouts) == int(errors) == 0, out
    assert re.search(r"^math-verify \S+; golds not scoring 1: 0$", out, re.M), out


@pytest.mark.slow
def test_graft_overhead_reads_what_the_experiment_writes(tmp_path):
    """The smallest real input: a one-step, one-seed experiment with the two arms the
    benchmark reads (GRPO n=8 and GRAFT), written by `graft-fed experiment` itself, so the
    folder layout the benchmark globs is the one the experiment writes."""
    import yaml

    out_dir = tmp_path / "miniature"
    arith = {"source": "embedded:arith-v1", "families": ["add"]}
    cfg = {
        "output_dir": str(out_dir), "seeds": [0],
        "models": {"llama": "zoo:tiny-llama-char", "gpt2": "zoo:tiny-gpt2-bpe"},
        "pairs": [["llama", "gpt2"]], "arms": ["grpo_n8", "graft"],
        "base": {
            "run": {"steps": 1, "device": "cpu", "threads": 1, "checkpoint_every": 0, "eval_before": False},
            "data": {**arith, "split": "train"},
            "rollout": {"max_new_tokens": 8},
            "verifier": {"name": "math_verify", "workers": 1},
            "algorithm": {"prompts_per_step": 2, "num_minibatches": 1},
            "eval": {"data": {**arith, "split": "test", "per_family": 2}, "k": 1},
        },
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(cfg))
    ok(run([sys.executable, "-m", "graft_fed.cli", "experiment", "--config", str(tmp_path / "exp.yaml"), "--quiet"]))

    out = ok(run([sys.executable, "bench/graft_overhead.py", str(out_dir)])).stdout
    lines = out.strip().splitlines()
    assert lines[0].startswith("| receiver | GRAFT steps | time/graft / step |"), out
    rows = table_rows(out)
    assert sorted(r[0] for r in rows) == ["gpt2", "llama"], out
    for recv, steps, share, g_step, b_step, ratio in rows:
        assert steps == "1" and re.fullmatch(r"\d+\.\d%", share), out
        assert float(g_step) > 0 and float(b_step) > 0 and float(ratio) > 0, out  # a GRPO n=8 run was found

    empty = run([sys.executable, "bench/graft_overhead.py", str(tmp_path / "nothing")])
    assert empty.returncode == 1 and "run graft-fed experiment first" in empty.stderr


@pytest.mark.slow
def test_fsdp_memory_under_torchrun():
    """`torchrun --nproc-per-node 2 bench/fsdp_memory.py --model zoo:tiny-llama-char` on CPU
    (gloo): each process holds about half of the fp32 parameters, as many gradient bytes and
    twice that in AdamW state, and gathers the whole model for a rollout."""
    from graft_fed.modeling import load_model_and_tokenizer

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
           "bench/fsdp_memory.py", "--model", "zoo:tiny-llama-char"]
    out = ok(run(cmd, timeout=300)).stdout
    model, _ = load_model_and_tokenizer("zoo:tiny-llama-char", "cpu")
    n_params = sum(p.numel() for p in model.parameters())
    assert f"zoo:tiny-llama-char: {n_params:,} parameters, 2 processes (gloo), bf16 False" in out, out
    rows = [[int(x.replace(",", "")) for x in line.split()] for line in out.splitlines()
            if re.fullmatch(r"\s*[01](\s+[\d,]+){5}\s*", line)]
    assert [r[0] for r in rows] == [0, 1], out
    assert sum(r[1] for r in rows) == 4 * n_params, out          # fp32 parameter shards cover the model once
    for _, params, grads, adam, total, gathered in rows:
        assert grads == params and adam == 2 * params and total == params + grads + adam, out
        assert gathered == 4 * n_params, out                     # the full weights, for a rollout


STEP_ROW_KEYS = {"rollout", "verify", "train", "step", "trainer/time_train", "other", "completion_tokens",
                 "mean_completion_length", "reward"}


@pytest.mark.slow
def test_step_time_graft_fed_side_and_report(tmp_path):
    """bench/step_time at the smallest size its options allow: graft_step.py with no warm-up
    and one timed step (the batch itself is fixed, common.BATCH), then report.py over that
    result and a copy of it relabelled as TRL's (the TRL side needs bench/step_time/.venv-trl,
    which the suite does not build); and every flag run.sh passes is one the scripts take."""
    runs = tmp_path / "runs"
    ok(run([sys.executable, "bench/step_time/graft_step.py", "--out", str(runs / "r1-graft-fed.json"),
            "--warmup", "0", "--steps", "1", "--scratch", str(tmp_path / "scratch")], timeout=300))
    result = json.loads((runs / "r1-graft-fed.json").read_text())
    assert result["framework"] == "graft-fed" and result["model"] == "zoo:tiny-llama-char"
    assert result["warmup"] == [] and len(result["timed"]) == 1
    row = result["timed"][0]
    assert set(row) == STEP_ROW_KEYS and set(result["median"]) == STEP_ROW_KEYS
    assert row["step"] > 0 and row["rollout"] > 0 and row["verify"] >= 0
    assert abs(row["rollout"] + row["verify"] + row["train"] - row["step"]) < 1e-6
    b = result["batch"]
    assert row["completion_tokens"] == pytest.approx(row["mean_completion_length"] * b["prompts_per_step"] * b["n"])
    assert 0.0 <= row["reward"] <= 1.0 and result["threads"] == b["threads"] == 1

    (runs / "r1-trl.json").write_text(json.dumps({**result, "framework": "trl"}))
    out_base = tmp_path / "results" / "step_time"
    md = ok(run([sys.executable, "bench/step_time/report.py", "--runs", str(runs), "--out", str(out_base),
                 "--load", "0.00 0.00 0.00"])).stdout
    report = json.loads(out_base.with_suffix(".json").read_text())
    assert set(report["frameworks"]) == {"graft-fed", "trl"}
    assert report["frameworks"]["graft-fed"]["timed_steps"] == 1
    assert report["ratio_trl_over_graft_fed"]["step"] == pytest.approx(1.0)
    assert report["adjacent_step_pair_ratio_median"] == pytest.approx(1.0)
    assert out_base.with_suffix(".md").read_text() == md.rstrip("\n") + "\n"
    assert "| graft-fed |" in md and "| trl |" in md and "**1.00x**" in md

    # run.sh's own flags, and the flags it passes to interleave.py and report.py
    usage = ok(run(["bash", "bench/step_time/run.sh", "--help"])).stdout
    for flag in ("--rounds", "--steps", "--warmup", "--threads", "--model"):
        assert flag in usage
    sh = (BENCH / "step_time" / "run.sh").read_text(encoding="utf-8").replace("\\\n", " ")
    for script in ("interleave.py", "report.py"):
        call = shlex.split(sh[sh.index(f'"$HERE/{script}"'):].split("\n")[0])
        passed = {t for t in call if t.startswith("--")}  # a quoted --command "..." is one token
        helptext = ok(run([sys.executable, f"bench/step_time/{script}", "--help"])).stdout
        missing = sorted(f for f in passed if f not in helptext)
        assert passed and not missing, f"run.sh passes {missing} to {script}, which does not take them"
