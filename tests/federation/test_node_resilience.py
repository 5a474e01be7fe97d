"""A node that loses the broker trains on with plain GRPO and rejoins when it returns."""

import dataclasses

import pytest

from graft_fed.errors import GraftFedError
from graft_fed.node.node import Node
from graft_fed.trainer.metrics import read_metrics
from tests.federation.helpers import broker_config, node_config, start_broker
from tests.federation.test_broker_crash import free_port


def test_node_trains_without_broker_and_reconnects(tiny_llama, prompt_file, tmp_path):
    port = free_port()
    cfg = node_config("solo", tiny_llama, prompt_file, tmp_path, f"127.0.0.1:{port}", steps=4,
                      rpc_timeout_s=3.0)
    with Node(cfg, quiet=True) as node:
        rows = [node.train_step() for _ in range(2)]
        assert [r["federation/connected"] for r in rows] == [0.0, 0.0]
        assert all(r["graft/replaced"] == 0 if "graft/replaced" in r else True for r in rows)
        broker = start_broker(broker_config(prompt_file, listen=f"127.0.0.1:{port}"))
        try:
            node.backoff.succeeded()  # the next attempt is due now rather than after the jittered delay
            # gRPC's channel retries the connection on its own backoff (at most 2 s apart); wait for it
            # here rather than inside the node's rpc timeout, so a loaded machine cannot fail the test
            assert node.client.wait_ready(30.0), "the node's channel never reconnected to the broker"
            rows += [node.train_step() for _ in range(2)]
        finally:
            broker.stop()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["federation/connected"] == 1.0 and rows[3]["federation/connected"] == 1.0


def test_a_killed_node_resumes_from_its_checkpoint_and_rejoins(tiny_llama, prompt_file, tmp_path):
    broker = start_broker(broker_config(prompt_file))
    try:
        cfg = node_config("n1", tiny_llama, prompt_file, tmp_path, broker.address, steps=4)
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, checkpoint_every=1))
        node = Node(cfg, quiet=True)
        node.ensure_joined()
        for _ in range(2):
            node.trainer.end_step(node.train_step())
        first_session = node.client.session
        node.close(leave=False)  # as if killed: no Leave, heartbeats stop
        with Node(cfg, resume="auto", quiet=True) as again:
            assert again.trainer.step == 2
            again.train(evaluate_before_after=False)
            assert again.client.session != first_session
        rows = [r for r in read_metrics(tmp_path / "n1" / "metrics.jsonl") if "reward" in r]
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert all(r["federation/connected"] == 1.0 for r in rows)
        assert {n["node_id"]: n["round"] for n in broker.fed.status()["nodes"]}["n1"] >= 3
    finally:
        broker.stop()


def test_a_node_that_normalises_advantages_otherwise_is_refused_naming_its_settings(tiny_llama, prompt_file, tmp_path):
    """Receivers train on the source's advantages as they are, so the manifest pins how they
    are computed: a node with algorithm.scale_rewards none is refused by a group/sample broker."""
    broker = start_broker(broker_config(prompt_file))
    try:
        cfg = node_config("dr", tiny_llama, prompt_file, tmp_path, broker.address)
        cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, scale_rewards="none"))
        with Node(cfg, quiet=True) as node, pytest.raises(GraftFedError) as info:
            node.ensure_joined()
        assert "advantage: broker has 'group/sample', node has 'none/sample'" in str(info.value)
        assert "algorithm.scale_rewards" in str(info.value)
        assert broker.state.get_node("dr") is None  # nothing of the refused node was kept
    finally:
        broker.stop()


def test_a_run_that_samples_its_rounds_again_is_told_why_it_cannot_exchange(tiny_llama, prompt_file, tmp_path,
                                                                            caplog):
    """The broker keeps the summaries a node id published first for each round, so the same
    node sampling those rounds again (here: its folder's node secret taken to a new run with
    another seed, as after a resume that sampled differently) has every bundle refused as not
    matching them. The node took that for a lost broker ("exchange with broker failed ...
    training plain GRPO"), joined again every step, and never said why; then it dropped the
    step's exchange. Now it says why, counts the refusals and still takes the groups offered
    to it."""
    import logging
    import shutil

    broker = start_broker(broker_config(prompt_file))
    try:
        first = node_config("n1", tiny_llama, prompt_file, tmp_path / "a", broker.address, steps=2)
        with Node(first, quiet=True) as node:
            node.train(evaluate_before_after=False)
        again = dataclasses.replace(first, run=dataclasses.replace(first.run, seed=first.run.seed + 1,
                                                                  output_dir=str(tmp_path / "b" / "n1")))
        (tmp_path / "b" / "n1").mkdir(parents=True)
        shutil.copy(tmp_path / "a" / "n1" / "node_secret", tmp_path / "b" / "n1" / "node_secret")
        with caplog.at_level(logging.WARNING, logger="graft_fed.node"), Node(again, quiet=True) as node:
            node.train(evaluate_before_after=False)
        said = [r.getMessage() for r in caplog.records if "refused round" in r.getMessage()]
        assert said and "an earlier run under this node id" in said[0] and "federation.node_id" in said[0]
        assert not [r for r in caplog.records if "exchange with broker" in r.getMessage()]
        rows = [r for r in read_metrics(tmp_path / "b" / "n1" / "metrics.jsonl") if "reward" in r]
        assert all(r["federation/connected"] == 1.0 for r in rows)  # it never lost the broker
        # nor dropped its step's exchange: the groups offered to it still come
        assert rows and all(r["federation/skipped"] == 0.0 for r in rows)
        assert rows[-1]["federation/uploads_refused_by_broker"] > 0
    finally:
        broker.stop()


def test_a_new_run_under_a_node_id_another_run_holds_is_refused_at_join(tiny_llama, prompt_file, tmp_path):
    """The first run's folder holds its node secret (0600), which holds the node id at the
    broker: a new run elsewhere under the same federation.node_id is refused at Join with
    what to do, and takes nothing over; the first run, restarted, joins as itself."""
    import os
    import stat

    broker = start_broker(broker_config(prompt_file))
    try:
        first = node_config("n1", tiny_llama, prompt_file, tmp_path / "a", broker.address, steps=1)
        with Node(first, quiet=True) as node:
            assert node.ensure_joined()
        held = tmp_path / "a" / "n1" / "node_secret"
        assert stat.S_IMODE(os.stat(held).st_mode) == 0o600
        other = dataclasses.replace(first, run=dataclasses.replace(first.run, output_dir=str(tmp_path / "b" / "n1")))
        with Node(other, quiet=True) as node, pytest.raises(GraftFedError) as info:
            node.ensure_joined()
        assert "held by another node" in str(info.value) and "node_secret" in str(info.value)
        assert "federation.node_id" in str(info.value)
        secret = held.read_text()
        with Node(first, quiet=True) as node:  # restarted in its own folder
            assert node.ensure_joined()
        assert held.read_text() == secret
    finally:
        broker.stop()
