"""What the broker shows while a federation runs: revoked and quarantined states, refused
calls counted and logged, per-node /metrics series, step scalars (ReportScalars), the live
page's data (/api/status) and the page itself, and `graft-fed status --json/--watch`."""

from __future__ import annotations

import json
import urllib.request

import pytest
import yaml

from graft_fed.broker.live import ScalarLog
from graft_fed.cli import main
from graft_fed.data.config import DataConfig, load_prompts
from graft_fed.federation.errors import FederationError, InvalidArgument
from graft_fed.node.client import BrokerClient
from tests.federation.helpers import broker_config, start_broker, stop_heartbeats
from tests.federation.test_broker_rpc import manifest, summary


def _get(server, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}{path}", timeout=10) as r:
        return r.headers.get("Content-Type"), r.read().decode()


@pytest.fixture()
def fed(prompt_file, tmp_path):
    allow = tmp_path / "allow.yaml"
    allow.write_text(yaml.safe_dump({"allowed": ["a", "b", "gone"], "revoked": []}))
    server = start_broker(broker_config(prompt_file, allowlist=str(allow)))
    prompts = load_prompts(DataConfig(source=str(prompt_file)))
    clients = {}
    for name in ("a", "b", "gone"):
        c = BrokerClient(server.address, name)
        c.join(name, "tok", manifest(prompts), "share_all", 0)
        clients[name] = c
    yield server, clients, prompts, allow
    for c in clients.values():
        c.close()
    server.stop()


def test_revoked_nodes_show_as_revoked_and_refusals_are_counted_and_logged(fed, capsys, caplog):
    server, clients, prompts, allow = fed
    # gone's heartbeat thread stops first: a heartbeat due between the revocation and the
    # scrape below (a slow machine) would be a second refused call from it
    stop_heartbeats(clients["gone"])  # the test counts gone's calls exactly
    allow.write_text(yaml.safe_dump({"allowed": ["a", "b"], "revoked": ["gone"]}))
    with pytest.raises(FederationError):
        clients["gone"].publish(0, [summary(prompts[0], 1)])
    stranger = BrokerClient(server.address, "stranger")
    with pytest.raises(FederationError):
        stranger.join("stranger", "tok", manifest(prompts), "share_all", 0)
    stranger.close()
    assert "refused a call from gone (revoked)" in caplog.text
    assert "refused a call from stranger (not_allowed)" in caplog.text
    _, metrics = _get(server, "/metrics")
    assert 'graft_fed_refused_total{reason="revoked"} 1' in metrics
    assert 'graft_fed_refused_by_identity_total{reason="not_allowed",identity="stranger"} 1' in metrics
    assert 'graft_fed_nodes{state="revoked"} 1' in metrics
    assert main(["status", "--broker", server.address, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    states = {n["node_id"]: n["state"] for n in d["nodes"]}
    assert states == {"a": "online", "b": "online", "gone": "revoked"}
    # the whole manifest, which a refused node's operator compares with the node's config
    assert d["manifest"]["seed"] == 3 and d["manifest"]["verifier_name"] == "tests.plugins:odd_char_sum"
    assert set(d["manifest"]) >= {"advantage", "protocol_version", "dataset_hash", "mode", "staleness_rounds"}
    assert main(["status", "--broker", server.address]) == 0
    out = capsys.readouterr().out
    assert "revoked" in out and "seed 3" in out and "verifier_name tests.plugins:odd_char_sum" in out


def test_per_node_series_scalars_and_the_page_data(fed):
    server, clients, prompts, _ = fed
    clients["a"].publish(0, [summary(p, 1) for p in prompts[:8]])
    assert clients["a"].report_scalars(1, {"reward": 0.5, "frac_all_fail": 0.25, "graft/replaced": 3.0,
                                           "time/step": 9.0})
    assert clients["a"].report_scalars(2, {"reward": 0.75, "eval/pass@1": 0.4, "eval/stderr": 0.05})
    assert clients["b"].report_scalars(1, {"reward": 0.1})
    assert not clients["b"].report_scalars(3, {"loss": 1.0})  # nothing the page plots: not sent
    _, metrics = _get(server, "/metrics")
    assert 'graft_fed_node_published_total{node="a"} 8' in metrics
    assert 'graft_fed_node_up{node="b",state="online"} 1.0' in metrics
    assert 'graft_fed_node_scalar{node="a",name="heldout_pass1"} 0.4' in metrics
    assert 'graft_fed_node_scalar{node="a",name="reward"} 0.75' in metrics
    ctype, body = _get(server, "/api/status")
    assert ctype == "application/json"
    view = json.loads(body)
    assert view["matrix"]["names"] == ["a", "b", "gone"]
    assert [r["step"] for r in view["curves"]["a"]] == [1, 2]
    assert view["curves"]["a"][0] == {"step": 1, "reward": 0.5, "all_fail": 0.25, "groups_received": 3.0}
    assert view["rounds"] and view["rounds"][0]["round"] == 0
    assert "session" not in body and "tls" not in body  # no secrets on the page
    ctype, page = _get(server, "/")
    assert ctype.startswith("text/html") and "api/status" in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page  # no CDN


def test_scalars_are_validated_and_need_a_session(fed):
    server, clients, _, _ = fed
    anonymous = BrokerClient(server.address, "a")  # no session: nothing to send under
    assert not anonymous.report_scalars(1, {"reward": 1.0})
    anonymous.session = "not-the-session"
    assert not anonymous.report_scalars(1, {"reward": 1.0})  # UNAUTHENTICATED: dropped, never raised
    anonymous.close()
    assert "a" not in server.servicer.scalars.series()
    log = ScalarLog(keep=3)
    for step in range(5):
        log.record("a", step, {"reward": float(step)})
    assert [r["step"] for r in log.series()["a"]] == [2, 3, 4]
    with pytest.raises(InvalidArgument):
        log.record("a", 1, {"Bad Name": 1.0})
    with pytest.raises(InvalidArgument):
        log.record("a", 1, {"reward": float("nan")})


def test_status_watch_prints_json_lines_until_interrupted(fed, capsys, monkeypatch):
    server, *_ = fed
    calls = {"n": 0}

    def sleep(_):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr("time.sleep", sleep)
    assert main(["status", "--broker", server.address, "--json", "--watch", "0.5"]) == 130
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all(json.loads(x)["current_round"] == 0 for x in lines)


def test_the_page_data_is_bounded_per_curve_and_keeps_sparse_scalars(fed):
    """Each node keeps up to 2,000 steps; the page gets at most CURVE_POINTS values of each
    scalar per node (the last included), so /api/status stays small however long the run,
    and a scalar reported every 20 steps keeps its own points rather than those of `reward`."""
    from graft_fed.broker.live import CURVE_POINTS

    server, _, _, _ = fed
    log = server.servicer.scalars
    for step in range(2000):
        log.record("a", step, {"reward": step / 2000, **({"heldout_pass1": step / 4000} if step % 20 == 0 else {})})
    curves = json.loads(_get(server, "/api/status")[1])["curves"]
    rows = curves["a"]
    reward = [r["step"] for r in rows if "reward" in r]
    held = [r["step"] for r in rows if "heldout_pass1" in r]
    assert len(reward) == CURVE_POINTS and reward[0] == 0 and reward[-1] == 1999
    assert held == list(range(0, 2000, 20))  # 100 <= CURVE_POINTS: all of them
    assert len(log.series()["a"]) == 2000  # what is kept is unchanged
    with pytest.raises(ValueError):
        log.series(max_points=1)
    assert set(log.series(["b", "nobody"])) <= {"b"}
