import argparse
import json

import pytest

from graft_fed.errors import DataError
from graft_fed.rewards import VerifierConfig, score_files
from graft_fed.rewards.cli import add_score_subparser


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def files(tmp_path):
    refs = write_jsonl(tmp_path / "refs.jsonl", [{"id": "q1", "answer": "\\frac{1}{2}"}, {"id": "q2", "answer": "7"},
                                                 {"id": 3, "answer": 12}])
    resps = write_jsonl(tmp_path / "resps.jsonl", [
        {"id": "q1", "response": "... \\boxed{0.5}"},
        {"id": "q1", "response": "... \\boxed{2}"},
        "",
        {"id": 3, "response": "\\boxed{12}"},
        {"id": "q9", "response": "\\boxed{1}"},
    ])
    return resps, refs


def test_round_trip(files, tmp_path):
    resps, refs = files
    out = tmp_path / "sub" / "scores.jsonl"
    summary = score_files(resps, refs, out, VerifierConfig(workers=1))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [
        {"id": "q1", "reward": 1.0, "status": "ok"},
        {"id": "q1", "reward": 0.0, "status": "ok"},
        {"id": 3, "reward": 1.0, "status": "fast_path"},
        {"id": "q9", "reward": 0.0, "status": "missing_reference"},
    ]
    assert summary["n"] == 4 and summary["scored"] == 3
    assert summary["mean_reward"] == pytest.approx(0.5)
    assert summary["missing_references"] == 1 and summary["missing_responses"] == 1
    assert summary["timeouts"] == summary["errors"] == 0 and summary["fast_path"] == 1


def test_cli_subcommand(files, tmp_path, capsys):
    resps, refs = files
    parser = argparse.ArgumentParser(prog="graft-fed")
    add_score_subparser(parser.add_subparsers(dest="command"))
    argv = ["score", "--responses", str(resps), "--references", str(refs), "--workers", "1", "--no-fast-path"]
    args = parser.parse_args(argv)
    with pytest.raises(DataError, match="have no reference"):  # the fixture has a response without a reference
        args.func(args)
    args = parser.parse_args(argv + ["--allow-missing"])
    assert args.func(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["fast_path"] == 0 and summary["n"] == 4 and summary["out"] is None


@pytest.mark.parametrize("refs_rows, resps_rows, fragment", [
    (["{not json"], [], "refs.jsonl:1: not valid JSON"),
    ([{"id": "a"}], [], "refs.jsonl:1: missing key 'answer'"),
    ([[1, 2]], [], "expected a JSON object"),
    ([{"id": "a", "answer": "1"}, {"id": "a", "answer": "2"}], [], "refs.jsonl:2: duplicate id 'a'"),
    ([{"id": 1.5, "answer": "1"}], [], "must be a string or an integer"),
    ([{"id": "a", "answer": "1"}], ["", {"id": "a", "response": None}], "resps.jsonl:2: \"response\" must be a string"),
])
def test_malformed_files_name_the_line(tmp_path, refs_rows, resps_rows, fragment):
    refs = write_jsonl(tmp_path / "refs.jsonl", refs_rows)
    resps = write_jsonl(tmp_path / "resps.jsonl", resps_rows)
    with pytest.raises(DataError, match=fragment):
        score_files(resps, refs)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="cannot read references file"):
        score_files(tmp_path / "r.jsonl", tmp_path / "nope.jsonl")
