"""End to end: a broker and three node processes over real gRPC on loopback."""

import json

import yaml

from graft_fed.sim import Simulation, load_sim_config
from tests.conftest import build_tiny_model


def test_broker_and_three_node_processes_exchange_and_reverify(tiny_llama, tiny_gpt2, prompt_file, tmp_path):
    third = build_tiny_model(tmp_path / "llama-b", "llama", seed=5)
    cfg = {
        "output_dir": str(tmp_path / "sim"),
        "broker": {"data": {"source": str(prompt_file)}, "verifier": {"name": "tests.plugins:odd_char_sum"},
                   "seed": 3, "n": 2, "prompts_per_round": 8, "round_deadline_s": 60, "min_nodes": 3,
                   "heartbeat_interval_s": 0.5, "offline_after_s": 20},
        "base": {"run": {"steps": 3, "seed": 3, "checkpoint_every": 0},
                 "data": {"source": str(prompt_file)},
                 "rollout": {"n": 2, "max_new_tokens": 6},
                 "verifier": {"name": "tests.plugins:odd_char_sum"},
                 "algorithm": {"prompts_per_step": 8, "num_minibatches": 2},
                 "eval": {"data": {"source": str(prompt_file), "max_prompts": 4}, "k": 2},
                 "federation": {"match_wait_s": 2.0, "round_timeout_s": 60, "fetch_timeout_s": 20}},
        "nodes": [{"name": "a", "model": {"path": str(tiny_llama)}},
                  {"name": "b", "model": {"path": str(tiny_gpt2)}},
                  {"name": "c", "model": {"path": str(third)}}],
        "timeout_s": 240,
    }
    path = tmp_path / "sim.yaml"
    path.write_text(yaml.safe_dump(cfg))
    table = Simulation(load_sim_config(path), 3, quiet=True).run()
    assert "| a |" in table and "| c |" in table
    replaced = reverified = 0
    for name in "abc":
        rows = [json.loads(x) for x in (tmp_path / "sim" / name / "metrics.jsonl").read_text().splitlines()]
        train_rows = [r for r in rows if "reward" in r]
        assert [r["step"] for r in train_rows] == [1, 2, 3]
        assert all(r["federation/connected"] == 1.0 for r in train_rows), "a node lost the broker"
        replaced += sum(r.get("graft/replaced", 0) for r in train_rows)
        reverified += sum(r.get("graft/reverified", 0) for r in train_rows)
        assert sum(r.get("graft/rejected_reverify", 0) for r in train_rows) == 0  # honest peers
    assert replaced > 0 and reverified >= replaced
    broker_log = (tmp_path / "sim" / "logs" / "broker.log").read_text()
    assert "round 0 matched" in broker_log or "matched" in broker_log


def test_sim_stops_when_a_node_exits_and_says_why_from_its_log(tiny_llama, prompt_file, tmp_path):
    """A node that cannot start (its model directory is missing) exits 2: the sim stops the
    federation at once with the node's own one-line reason, not after round deadlines."""
    import time

    import pytest

    from graft_fed.errors import GraftFedError

    cfg = {
        "output_dir": str(tmp_path / "sim"),
        "broker": {"data": {"source": str(prompt_file)}, "verifier": {"name": "tests.plugins:odd_char_sum"},
                   "seed": 3, "n": 2, "prompts_per_round": 8, "round_deadline_s": 300, "min_nodes": 2},
        "base": {"run": {"steps": 50, "seed": 3}, "data": {"source": str(prompt_file)},
                 "rollout": {"n": 2, "max_new_tokens": 6}, "verifier": {"name": "tests.plugins:odd_char_sum"},
                 "algorithm": {"prompts_per_step": 8, "num_minibatches": 2},
                 "eval": {"data": {"source": str(prompt_file), "max_prompts": 2}, "k": 2}},
        "nodes": [{"name": "ok", "model": {"path": str(tiny_llama)}},
                  {"name": "broken", "model": {"path": str(tmp_path / "no-such-model")}}],
        "timeout_s": 120,
    }
    path = tmp_path / "sim.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.monotonic()
    with pytest.raises(GraftFedError) as err:
        Simulation(load_sim_config(path), 2, quiet=True).run()
    assert time.monotonic() - t0 < 100  # at once: not at its 120 s timeout nor a 300 s round deadline
    msg = str(err.value)
    assert "node broken exited with code 2" in msg and "does not exist" in msg and "broken.log" in msg


def test_exit_reason_and_result_table_for_failed_and_resumed_nodes(tmp_path):
    from graft_fed.sim import exit_reason, result_table

    log = tmp_path / "n.log"
    log.write_text("INFO starting\ngraft-fed node: error: certificate expired 3 days ago\n")
    assert exit_reason(log) == "certificate expired 3 days ago"
    log.write_text("INFO x\nTraceback (most recent call last):\n  File \"a.py\", line 1\nValueError: boom\n")
    assert exit_reason(log) == "ValueError: boom"
    # "a" was resumed: its summary has no eval_before, its step-0 evaluation file has
    (tmp_path / "a" / "eval").mkdir(parents=True)
    (tmp_path / "a" / "eval" / "step_000000.summary.json").write_text(json.dumps({"pass@1": 0.25}))
    (tmp_path / "a" / "summary.json").write_text(json.dumps({"eval_after": {"pass@1": 0.5}}))
    (tmp_path / "a" / "metrics.jsonl").write_text("")
    table = result_table(tmp_path, ["a", "b"], failed={"b": (2, "model path does not exist")})
    assert "| a | 25.0 | 50.0 | +25.0 |" in table
    assert "| b | exited with code 2: model path does not exist |" in table


def test_sim_can_go_on_without_an_exited_node_and_says_what_that_costs(tmp_path, capsys):
    from graft_fed.sim import SimConfig, SimNode

    class Proc:
        def __init__(self, code):
            self.code = code

        def poll(self):
            return self.code

    cfg = SimConfig(output_dir=str(tmp_path), on_node_exit="continue",
                    broker={"min_nodes": 3, "round_deadline_s": 300},
                    nodes=(SimNode(name="a"), SimNode(name="b"), SimNode(name="c")))
    sim = Simulation(cfg, 3, quiet=True)
    sim.procs = {"broker": Proc(None), "a": Proc(None), "b": Proc(2), "c": Proc(None)}
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "b.log").write_text("graft-fed node: error: never joined the broker: UNAVAILABLE\n")
    sim._node_exited("b", 2)
    err = capsys.readouterr().err
    assert "node b exited with code 2: never joined the broker" in err and "continuing with a, c" in err
    assert "min_nodes=3 can no longer be met" in err and "300" in err
    assert sim.failed == {"b": (2, "never joined the broker: UNAVAILABLE")}
    assert "b: EXITED 2" in sim._progress()


def test_sim_refuses_an_earlier_sims_folder_and_says_why_its_broker_stopped(prompt_file, tmp_path):
    """A sim never continues an earlier sim's federation in its folder (its nodes would join at
    the earlier last round and the table would mix both runs); a broker that exits at start
    is reported with its own reason; and a broker.min_nodes above the nodes run is lowered."""
    import pytest

    from graft_fed.errors import GraftFedError

    broker = {"data": {"source": str(prompt_file)}, "verifier": {"name": "tests.plugins:odd_char_sum"},
              "seed": 3, "n": 2, "prompts_per_round": 8}
    cfg = {"output_dir": str(tmp_path / "sim"), "broker": {**broker, "allowlist": str(tmp_path / "no-such.yaml")},
           "base": {"data": {"source": str(prompt_file)}, "verifier": {"name": "tests.plugins:odd_char_sum"}},
           "nodes": [{"name": "a", "model": {"path": str(tmp_path / "unused")}}], "timeout_s": 60}
    path = tmp_path / "sim.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(GraftFedError, match=r"the broker exited at start \(code 2\): allowlist .*no-such.yaml does "
                                            "not exist"):
        Simulation(load_sim_config(path), 1, quiet=True).run()
    fixed = {"broker.allowlist": None}
    # the refused broker left an empty state: nothing to continue, so the fixed config may run there
    assert (tmp_path / "sim" / "broker.sqlite").exists()
    assert Simulation(load_sim_config(path, fixed), 1, quiet=True).earlier_run() == []
    from graft_fed.broker.config import load_broker_config
    from graft_fed.broker.handlers import Federation
    from graft_fed.broker.server import open_state

    state = open_state(str(tmp_path / "sim" / "broker.sqlite"))
    fed = Federation(load_broker_config(None, broker), state)
    fed.join("a", "m", "tok", fed.manifest, "share_all", 0)  # a node of the earlier sim
    fed.stop()
    state.close()
    (tmp_path / "sim" / "a").mkdir()
    (tmp_path / "sim" / "a" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(GraftFedError, match=r"holds an earlier sim \(broker.sqlite, a/\).*--output-dir"):
        Simulation(load_sim_config(path, fixed), 1, quiet=True).run()
    assert (tmp_path / "sim" / "a" / "metrics.jsonl").read_text() == "{}\n"  # nothing touched
    sim = Simulation(load_sim_config(path, {**fixed, "broker.min_nodes": 3, "output_dir": str(tmp_path / "sim2")}),
                     1, quiet=True)
    try:
        sim.start_broker()
        config = yaml.safe_load((tmp_path / "sim2" / "configs" / "broker.yaml").read_text())
        assert config["min_nodes"] == 1 and config["seed"] == 3 and sim.min_nodes == 1
    finally:
        sim.stop()
