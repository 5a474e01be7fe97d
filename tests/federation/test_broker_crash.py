"""SIGKILL the broker mid-run, restart it on the same database: every acknowledged summary
and bundle is still there, nothing is duplicated, and nodes carry on."""

import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import yaml

from graft_fed.federation.errors import Unavailable
from graft_fed.node.client import BrokerClient
from tests.federation.test_broker_rpc import client, record, summary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cfg_path, port_file):
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "graft_fed.cli", "broker", "--config", str(cfg_path),
                             "--port-file", str(port_file)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert proc.poll() is None, "broker exited at start"
        assert time.monotonic() < deadline, "broker did not start"
        time.sleep(0.05)
    return proc


class _Addr:
    def __init__(self, address):
        self.address = address


def test_sigkill_loses_nothing_acknowledged(prompt_file, tmp_path):
    from graft_fed.data.config import DataConfig, load_prompts

    prompts = load_prompts(DataConfig(source=str(prompt_file)))
    port = free_port()
    cfg = {"listen": f"127.0.0.1:{port}", "http": "", "db": str(tmp_path / "broker.sqlite"),
           "data": {"source": str(prompt_file)}, "verifier": {"name": "tests.plugins:odd_char_sum"},
           "seed": 3, "n": 2, "prompts_per_round": 8, "round_deadline_s": 30}
    cfg_path = tmp_path / "broker.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    port_file = tmp_path / "port"
    proc = start(cfg_path, port_file)
    addr = _Addr(f"127.0.0.1:{port}")
    a = client(addr, prompts, "a")
    acked_summaries = [summary(p, 1) for p in prompts[:6]]
    assert a.publish(0, acked_summaries) == (6, 0)
    digests = [a.upload(record(p, 1), 0)[0] for p in prompts[:4]]

    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    with_broker_down = BrokerClient(addr.address, "a", rpc_timeout_s=1.0)
    with_broker_down.session = a.session
    try:
        with_broker_down.publish(0, [summary(prompts[6], 1)])
        raise AssertionError("the broker is dead; the call cannot succeed")
    except Unavailable as exc:  # DeadlineExceeded is one
        assert exc.status in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    with_broker_down.close()

    proc = start(cfg_path, port_file)
    try:
        assert a.wait_ready(30)
        # the session survived the crash (it is durable state), so the node carries on without re-joining
        assert a.has_bundles(digests) == set(digests)
        assert a.publish(0, acked_summaries) == (0, 6)  # all there, no duplicate
        st = a.status()
        assert [n.published for n in st.nodes if n.node_id == "a"] == [6]
        assert st.bundles == 4
        assert a.publish(0, [summary(prompts[6], 1)]) == (1, 0)  # and new work is accepted
    finally:
        a.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
