import json
import random
import sys
import types
from pathlib import Path

import pytest

from graft_fed.data.config import DataConfig, load_prompts
from graft_fed.data.loaders import (BENCHMARKS, BENCHMARKS_ENV, gsm8k_final_answer, load_benchmark, load_hf_dataset,
                                    load_prompt_file, strip_paper_suffix)
from graft_fed.data.prompts import stable_prompt_id
from graft_fed.data.templates import PAPER_SUFFIX
from graft_fed.errors import ConfigError, DataError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"
ROWS = [{"problem": "What is 1+1?", "answer": "2", "uid": "a"},
        {"problem": f"What is 2+3?\n{PAPER_SUFFIX}", "answer": 5, "uid": "b"},
        {"problem": "Solve x^2=4 for x>0.", "answer": "2", "uid": "c"}]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_jsonl_loading_with_defaults(tmp_path):
    prompts = load_prompt_file(write_jsonl(tmp_path / "tiny-set.jsonl", ROWS))
    assert [p.problem for p in prompts] == ["What is 1+1?", "What is 2+3?", "Solve x^2=4 for x>0."]
    assert [p.answer for p in prompts] == ["2", "5", "2"]
    assert {p.dataset for p in prompts} == {"tiny-set"}
    assert prompts[0].id == stable_prompt_id("tiny-set", "What is 1+1?")


def test_field_mapping_and_source_ids(tmp_path):
    rows = [{"question": r["problem"], "solution": r["answer"], "uid": r["uid"]} for r in ROWS]
    prompts = load_prompt_file(write_jsonl(tmp_path / "x.jsonl", rows), dataset_id="mine", problem_field="question",
                               answer_field="solution", id_field="uid", answer_transform=lambda a: f"{a}")
    assert [p.meta["source_id"] for p in prompts] == ["a", "b", "c"]
    assert {p.dataset for p in prompts} == {"mine"}


def test_parquet_gives_the_same_prompts_as_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{**r, "answer": str(r["answer"])} for r in ROWS]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "set.parquet")
    from_parquet = load_prompt_file(tmp_path / "set.parquet")
    from_jsonl = load_prompt_file(write_jsonl(tmp_path / "set.jsonl", rows))
    assert from_parquet == from_jsonl


def test_parquet_row_errors_name_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"problem": "p", "answer": "1"}, {"problem": "q", "answer": None}]),
                   tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet:row 2: missing field 'answer'"):
        load_prompt_file(tmp_path / "bad.parquet")


def test_ids_do_not_depend_on_row_order_or_the_suffix(tmp_path):
    shuffled = ROWS[:]
    random.Random(1).shuffle(shuffled)
    with_suffix = [{**r, "problem": f"{r['problem']}\n{PAPER_SUFFIX}"} for r in ROWS]
    by_problem = [{p.problem: p.id for p in load_prompt_file(write_jsonl(tmp_path / "d.jsonl", rows))}
                  for rows in (ROWS, shuffled, with_suffix)]
    assert by_problem[0] == by_problem[1] == by_problem[2]


def test_suffix_stripping():
    assert strip_paper_suffix(f"Find x.\n{PAPER_SUFFIX}\n") == "Find x."
    assert strip_paper_suffix(f"Find x. {PAPER_SUFFIX}") == "Find x."
    assert strip_paper_suffix("Find x.") == "Find x."


def test_gsm8k_answer_extraction():
    assert gsm8k_final_answer("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18") == "18"
    assert gsm8k_final_answer("... #### 2,125") == "2125"
    assert gsm8k_final_answer("#### -1,450,000") == "-1450000"
    assert gsm8k_final_answer("#### 3.5") == "3.5"
    with pytest.raises(ValueError, match="####"):
        gsm8k_final_answer("no marker 18")


def test_duplicates_are_dropped_with_a_warning(tmp_path):
    rows = ROWS + [{"problem": "What is  1+1? ", "answer": "2"}, {"problem": "What is 2+3?", "answer": "6"}]
    with pytest.warns(UserWarning, match=r"dropped 2 duplicate problem\(s\); 1 of them with a DIFFERENT answer"):
        prompts = load_prompt_file(write_jsonl(tmp_path / "d.jsonl", rows))
    assert [p.answer for p in prompts] == ["2", "5", "2"]


@pytest.mark.parametrize("rows, fragment", [
    (['{"problem": "p", "answer": "1"}', "{oops"], r"m.jsonl:2: not valid JSON"),
    ([{"problem": "p"}], r"m.jsonl:1: missing field 'answer'"),
    ([{"problem": "", "answer": "1"}], r"m.jsonl:1: field 'problem' must be a non-empty string"),
    ([{"problem": 3, "answer": "1"}], r"m.jsonl:1: field 'problem' must be a non-empty string"),
    ([{"problem": "p", "answer": ["1", "2"]}], r"m.jsonl:1: bad field 'answer'.*answer_transform"),
    ([{"problem": "p", "answer": "  "}], r"m.jsonl:1: field 'answer' is empty"),
    (['"just a string"'], r"m.jsonl:1: expected an object"),
    ([""], r"no prompts"),
])
def test_malformed_rows_name_file_and_line(tmp_path, rows, fragment):
    with pytest.raises(DataError, match=fragment):
        load_prompt_file(write_jsonl(tmp_path / "m.jsonl", rows))


def test_unsupported_and_missing_files(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="use .jsonl or .parquet"):
        load_prompt_file(tmp_path / "x.csv")
    with pytest.raises(DataError, match="does not exist"):
        load_prompt_file(tmp_path / "nope.jsonl")


def test_missing_pyarrow_message(tmp_path, monkeypatch):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"needs pyarrow.*pip install 'graft-fed\[data\]'"):
        load_prompt_file(tmp_path / "x.parquet")


def test_missing_datasets_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"needs the 'datasets' package.*pip install"):
        load_hf_dataset("org/set", "test")


def fake_datasets(rows):
    calls = []

    def load_dataset(hub_id, config_name=None, split=None, revision=None):
        calls.append((hub_id, config_name, split))
        return rows

    return types.SimpleNamespace(load_dataset=load_dataset), calls


def test_hf_loading_through_the_datasets_api(monkeypatch):
    module, calls = fake_datasets([{"q": "What is 1+1?", "a": "2"}])
    monkeypatch.setitem(sys.modules, "datasets", module)
    prompts = load_prompts(DataConfig(source="hf:org/set:main", split="test", problem_field="q", answer_field="a"))
    assert calls == [("org/set", "main", "test")]
    assert prompts[0].dataset == "org/set/main" and prompts[0].answer == "2"


def test_benchmark_registry_on_fixtures(monkeypatch):
    monkeypatch.delenv(BENCHMARKS_ENV, raising=False)
    for name in BENCHMARKS:
        prompts = load_benchmark(name, root=FIXTURES)
        assert len(prompts) == 3, name
        assert all(p.dataset == name for p in prompts)
        assert all(not p.problem.rstrip().endswith(PAPER_SUFFIX) for p in prompts)
    assert [p.answer for p in load_benchmark("gsm8k", root=FIXTURES)] == ["18", "3", "2125"]
    assert load_benchmark("amc23", root=FIXTURES)[0].answer == "27"


def test_benchmark_root_from_env_and_by_path(monkeypatch):
    monkeypatch.setenv(BENCHMARKS_ENV, str(FIXTURES))
    assert load_benchmark("gsm8k") == load_benchmark(FIXTURES / "gsm8k_test.jsonl")
    assert load_prompts(DataConfig(source="aime24"))[0].answer == "204"


def test_benchmark_errors(monkeypatch, tmp_path):
    monkeypatch.delenv(BENCHMARKS_ENV, raising=False)
    with pytest.raises(DataError, match=f"pass root=.*or set {BENCHMARKS_ENV}"):
        load_benchmark("math500")
    with pytest.raises(DataError, match="must hold math500.jsonl"):
        load_benchmark("math500", root=tmp_path)
    with pytest.raises(DataError, match="neither a benchmark name"):
        load_benchmark("math5000", root=tmp_path)


def test_data_config_file_source_and_max_prompts(tmp_path):
    path = write_jsonl(tmp_path / "f.jsonl", ROWS)
    prompts = load_prompts(DataConfig(source=str(path), max_prompts=2, id_field="uid"))
    assert [p.meta["source_id"] for p in prompts] == ["a", "b"]


def test_data_config_benchmark_source():
    prompts = load_prompts(DataConfig(source="minerva"), benchmarks_root=FIXTURES)
    assert [p.answer for p in prompts] == ["1.6", "4.5e33", "3.83e35"]


def test_data_config_embedded_source():
    pytest.importorskip("graft_fed.data.task")
    prompts = load_prompts(DataConfig(source="embedded:arith-v1", split="validation", per_family=2, max_prompts=3))
    assert len(prompts) == 3
    with pytest.raises(ConfigError, match="unknown embedded task"):
        load_prompts(DataConfig(source="embedded:nope"))


@pytest.mark.parametrize("kwargs, fragment", [
    ({"source": ""}, "must name a source"),
    ({"source": "data.csv"}, "ending in .jsonl or .parquet"),
    ({"source": "hf:"}, "needs a hub id"),
    ({"source": "math500", "families": ("add",)}, "only apply to embedded"),
    ({"per_family": 0}, "per_family"),
    ({"max_prompts": 0}, "max_prompts"),
    ({"problem_field": ""}, "problem_field"),
    ({"families": ["add"]}, "families"),
])
def test_data_config_validation(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        DataConfig(**kwargs)


MATH_SAMPLE = FIXTURES.parent / "math_train_sample.jsonl"


def test_math_train_rows_with_worked_solutions():
    """MATH train as published ({problem, level, type, solution}): the gold answer is the
    solution's last \\boxed{}; the dataset id is what every node sets, however it loads it."""
    prompts = load_prompts(DataConfig(source=str(MATH_SAMPLE), answer_field="solution", answer_format="boxed",
                                      dataset_id="math-train"))
    assert [p.answer for p in prompts] == ["\\frac{5}{6}", "4", "6", "7"]
    assert {p.dataset for p in prompts} == {"math-train"}
    assert prompts[3].problem == "Evaluate $\\sqrt{49}$."  # the paper's suffix is stripped
    assert prompts[1].id == stable_prompt_id("math-train", "Find $x$ if $2x + 3 = 11$.")
    # The same rows through the hub give the same ids when the dataset id is the same.
    rows = [json.loads(line) for line in MATH_SAMPLE.read_text().splitlines()]
    module, calls = fake_datasets(rows)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "datasets", module)
        hub = load_prompts(DataConfig(source="hf:someone/MATH", split="train", answer_field="solution",
                                      answer_format="boxed", dataset_id="math-train"))
    assert calls == [("someone/MATH", None, "train")]
    assert [(p.id, p.answer) for p in hub] == [(p.id, p.answer) for p in prompts]


def test_boxed_answers_missing_or_unclosed_name_the_line(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"problem": "a", "solution": "so \\boxed{3}"},
                                             {"problem": "b", "solution": "no box here"}])
    with pytest.raises(DataError, match=r"m.jsonl:2: bad field 'solution': .*no complete \\boxed"):
        load_prompts(DataConfig(source=str(path), answer_field="solution", answer_format="boxed"))
    path = write_jsonl(tmp_path / "n.jsonl", [{"problem": "a", "solution": "cut \\boxed{\\frac{1}{2"}])
    with pytest.raises(DataError, match="n.jsonl:1"):
        load_prompts(DataConfig(source=str(path), answer_field="solution", answer_format="boxed"))


def test_gsm8k_answer_format_for_files(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "work\n#### 1,250"}])
    prompts = load_prompts(DataConfig(source=str(path), problem_field="question", answer_format="gsm8k"))
    assert prompts[0].answer == "1250"


@pytest.mark.parametrize("kwargs, fragment", [
    ({"answer_format": "latex"}, "answer_format must be one of plain, boxed, gsm8k"),
    ({"dataset_id": ""}, "dataset_id"),
    ({"source": "math500", "answer_format": "boxed"}, "only apply to files and hf"),
    ({"source": "embedded:arith-v1", "dataset_id": "x"}, "only apply to files and hf"),
])
def test_answer_format_and_dataset_id_validation(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        DataConfig(**kwargs)
