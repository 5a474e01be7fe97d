"""A node that loses the broker trains on with plain GRPO and rejoins when it returns."""

from graft_fed.node.node import Node
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
            rows += [node.train_step() for _ in range(2)]
        finally:
            broker.stop()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["federation/connected"] == 1.0 and rows[3]["federation/connected"] == 1.0
