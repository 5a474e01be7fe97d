"""Network faults between a node and the broker, injected by a TCP proxy on loopback
(tests/federation/faultproxy.py): the node trains on with plain GRPO while the link is
down, reconnects when it heals, publishes the rounds it missed, and the broker ends up
with every group exactly once."""

import socket
import threading
import time

import pytest

from graft_fed.node.node import Node
from tests.federation.faultproxy import FaultProxy
from tests.federation.helpers import broker_config, node_config, start_broker


# ----- the proxy itself ---------------------------------------------------------------------------

@pytest.fixture()
def echo_address():
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn):
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                conn.sendall(data)

    def accept():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    t.join()
    server.close()


def connect(address, timeout=5.0):
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exactly(s, n):
    out = b""
    while len(out) < n:
        data = s.recv(n - len(out))
        if not data:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += data
    return out


def eventually(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_proxy_pass_delay_keeps_order(echo_address):
    with FaultProxy(echo_address, seed=1) as proxy:
        s = connect(proxy.address)
        s.sendall(b"ping")
        assert recv_exactly(s, 4) == b"ping"
        proxy.set("delay", delay_s=0.05, jitter_s=0.05)
        t0 = time.monotonic()
        s.sendall(b"x")
        assert recv_exactly(s, 1) == b"x"
        assert time.monotonic() - t0 >= 0.1  # held at least delay_s on the way in and again on the way out
        payload = b"".join(bytes([i]) for i in range(100))
        for i in range(100):  # 100 chunks with random jitter: none overtakes an earlier one
            s.sendall(payload[i:i + 1])
            time.sleep(0.001)
        assert recv_exactly(s, 100) == payload
        s.close()
        eventually(lambda: proxy.stats["bytes_up"] == proxy.stats["bytes_down"] == 105)  # counted after sending
        assert proxy.stats["connections"] == 1


def test_proxy_drop_stalls_open_connections_and_blackholes_new_ones(echo_address):
    with FaultProxy(echo_address) as proxy:
        s = connect(proxy.address)
        s.sendall(b"up")
        assert recv_exactly(s, 2) == b"up"  # established through the proxy before the partition
        proxy.set("drop")
        s.sendall(b"held")
        s.settimeout(0.3)
        with pytest.raises(socket.timeout):
            s.recv(4)  # nothing gets through while partitioned
        fresh = connect(proxy.address)  # accepted ...
        fresh.sendall(b"lost")
        fresh.settimeout(0.3)
        with pytest.raises(socket.timeout):
            fresh.recv(4)  # ... but blackholed
        proxy.set("pass")
        s.settimeout(5)
        assert recv_exactly(s, 4) == b"held"  # the stalled bytes flow once the link heals
        fresh.settimeout(5)
        with pytest.raises((ConnectionError, OSError)):
            recv_exactly(fresh, 4)  # the blackholed connection is reset: its bytes are gone
        assert proxy.stats["blackholed"] == 1
        eventually(lambda: proxy.stats["bytes_dropped"] == 4)
        after = connect(proxy.address)
        after.sendall(b"ok")
        assert recv_exactly(after, 2) == b"ok"
        for c in (s, fresh, after):
            c.close()


def test_proxy_reset_and_schedule(echo_address):
    with FaultProxy(echo_address) as proxy:
        s = connect(proxy.address)
        s.sendall(b"a")
        assert recv_exactly(s, 1) == b"a"
        proxy.schedule([("reset", 3.0), ("pass", None)])  # long enough for the checks below on a loaded machine
        with pytest.raises(ConnectionResetError):
            for _ in range(100):  # the open connection is reset (RST, not FIN)
                s.sendall(b"b")
                s.recv(1)
                time.sleep(0.01)
        with pytest.raises((ConnectionError, OSError)):
            fresh = connect(proxy.address)  # may already fail here: the proxy resets right after accepting
            fresh.sendall(b"c")
            recv_exactly(fresh, 1)  # and so is a new one while the schedule says reset
        eventually(lambda: proxy.mode == "pass", 10.0)  # the schedule recovers on its own
        ok = connect(proxy.address)
        ok.sendall(b"d")
        assert recv_exactly(ok, 1) == b"d"
        assert [m for _, m in proxy.history] == ["reset", "pass"]
        assert proxy.stats["reset_open"] >= 1 and proxy.stats["reset_at_accept"] >= 1
        for c in (s, ok):
            c.close()


# ----- a real node through the proxy -------------------------------------------------------------

def _watch_acks(node):
    """Record every publish the broker acknowledged: (round, prompt ids)."""
    acked = []
    publish = node.client.publish

    def wrapped(round, summaries):
        out = publish(round, summaries)
        acked.append((round, [s.prompt_id for s in summaries]))
        return out

    node.client.publish = wrapped
    return acked


def _check_broker_has_every_round_once(broker, node_id, acked, rounds):
    rows = broker.state.summaries(node_id=node_id)
    keys = [(s.round, s.prompt_id) for s in rows]
    assert len(keys) == len(set(keys))  # nothing duplicated
    assert sorted({r for r, _ in keys}) == list(range(rounds))  # every step's round arrived
    assert all(len([k for k in keys if k[0] == r]) == 8 for r in range(rounds))
    assert {(r, p) for r, pids in acked for p in pids} <= set(keys)  # nothing acknowledged lost
    node = [n for n in broker.fed.status()["nodes"] if n["node_id"] == node_id][0]
    assert node["published"] == len(keys)  # the broker's count agrees: retries were not counted twice


@pytest.mark.parametrize("fault,direction", [("drop", "both"), ("reset", "both"), ("drop", "down")],
                         ids=["partition", "reset", "lost-answers"])
def test_node_trains_through_a_network_fault_and_catches_up(fault, direction, tiny_llama, prompt_file, tmp_path):
    broker = start_broker(broker_config(prompt_file))
    proxy = FaultProxy(broker.address).start()
    # calls given 5 s while the link is sound (a loaded machine may take over 1 s to answer),
    # 1 s while it is faulty, so that the steps it fails are quick
    cfg = node_config("n1", tiny_llama, prompt_file, tmp_path, proxy.address, steps=10, rpc_timeout_s=5.0,
                      match_wait_s=0.5)
    try:
        with Node(cfg, quiet=True) as node:
            acked = _watch_acks(node)
            assert node.ensure_joined()
            rows = [node.train_step()]
            node.client.timeout = 1.0
            proxy.set(fault, direction=direction)
            rows += [node.train_step() for _ in range(2)]
            proxy.set("pass")
            node.client.timeout = 5.0
            node.backoff.succeeded()  # the next attempt is due now rather than after the jittered delay
            while rows[-1]["federation/connected"] != 1.0 or node.backlog:
                assert len(rows) < 8, f"no recovery: {[r['federation/connected'] for r in rows]}"
                rows.append(node.train_step())
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # training never stopped
        assert [(r["federation/connected"], r["federation/skipped"]) for r in rows[:3]] == [
            (1.0, 0.0), (0.0, 1.0), (0.0, 1.0)]  # plain GRPO while the link was down
        assert rows[2]["federation/backlog_rounds"] == 2.0
        assert sum(r.get("federation/backlog_published", 0) for r in rows) >= 2
        assert rows[-1]["federation/backlog_rounds"] == 0.0
        _check_broker_has_every_round_once(broker, "n1", acked, len(rows))
        if fault == "reset":
            assert proxy.stats["reset_open"] >= 1  # the node's open connection was torn down
        if direction == "down":
            # the broker stored round 1 but its answer was lost; the node's retry was a duplicate
            assert broker.fed.counters["duplicate_summaries"] >= 8
    finally:
        proxy.close()
        broker.stop()


def test_node_exchanges_through_a_slow_jittery_link(tiny_llama, prompt_file, tmp_path):
    broker = start_broker(broker_config(prompt_file))
    proxy = FaultProxy(broker.address, seed=2).start()
    proxy.set("delay", delay_s=0.02, jitter_s=0.03)
    cfg = node_config("n1", tiny_llama, prompt_file, tmp_path, proxy.address, steps=2)
    try:
        with Node(cfg, quiet=True) as node:
            acked = _watch_acks(node)
            rows = [node.train_step() for _ in range(2)]
        assert [(r["federation/connected"], r["federation/skipped"]) for r in rows] == [(1.0, 0.0), (1.0, 0.0)]
        assert "federation/round_timeout" not in rows[0] and "federation/round_timeout" not in rows[1]
        _check_broker_has_every_round_once(broker, "n1", acked, 2)
        assert proxy.stats["bytes_up"] > 0 and proxy.stats["bytes_down"] > 0
    finally:
        proxy.close()
        broker.stop()
