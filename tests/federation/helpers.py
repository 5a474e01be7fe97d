"""Shared set-up for federation tests: a broker on 127.0.0.1:0 and node configs."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

from graft_fed.broker.config import BrokerConfig
from graft_fed.broker.server import BrokerServer
from graft_fed.configbase import from_mapping
from graft_fed.node.client import BrokerClient
from graft_fed.node.node import Node, NodeConfig
from graft_fed.trainer.config import member_seed


def broker_config(prompt_file: Path, db: str = ":memory:", **over: Any) -> BrokerConfig:
    base = {"listen": "127.0.0.1:0", "http": "127.0.0.1:0", "db": db, "data": {"source": str(prompt_file)},
            "verifier": {"name": "tests.plugins:odd_char_sum"}, "seed": 3, "n": 2, "prompts_per_round": 8,
            "round_deadline_s": 30.0, "heartbeat_interval_s": 0.2, "offline_after_s": 5.0}
    base.update(over)
    return from_mapping(BrokerConfig, base)


def node_config(name: str, model_dir: Path, prompt_file: Path, out: Path, address: str, steps: int = 2,
                **fed: Any) -> NodeConfig:
    cfg = {
        # each node samples with its own seed (as a co-training member named alike would), all
        # share the broker's prompt schedule (seed 3)
        "run": {"name": name, "output_dir": str(out / name), "steps": steps, "seed": member_seed(3, name),
                "schedule_seed": 3, "device": "cpu",
                "threads": 1, "checkpoint_every": 0},
        "model": {"path": str(model_dir)},
        "data": {"source": str(prompt_file)},
        "rollout": {"n": 2, "max_new_tokens": 6},
        "verifier": {"name": "tests.plugins:odd_char_sum"},
        "algorithm": {"prompts_per_step": 8, "num_minibatches": 2},
        "optim": {"lr": 1e-3},
        "federation": {"broker": address, "match_wait_s": 2.0, "round_timeout_s": 30.0, "fetch_timeout_s": 10.0,
                       "reconnect_min_s": 0.1, "reconnect_max_s": 0.5, **fed},
    }
    return from_mapping(NodeConfig, cfg)


def run_nodes(cfgs: list[NodeConfig]) -> list[dict]:
    """Train several nodes concurrently (threads), as separate sites would. Models are
    loaded one after another first: transformers' loading is not thread-safe."""
    results: list[Any] = [None] * len(cfgs)
    errors: list[BaseException] = []
    nodes = [Node(cfg, quiet=True) for cfg in cfgs]

    def work(i: int) -> None:
        try:
            with nodes[i] as node:
                results[i] = node.train(evaluate_before_after=False)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cfgs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return results


def start_broker(cfg: BrokerConfig) -> BrokerServer:
    return BrokerServer(cfg).start()


def stop_heartbeats(client: BrokerClient) -> None:
    """Stop a client's heartbeat thread and wait for it to end, however long its last beat
    takes (the client's own stop waits 2 s at most): a test that counts the client's calls
    exactly then sees no beat arrive later."""
    thread = client._hb_thread  # noqa: SLF001
    client._stop_heartbeats()  # noqa: SLF001
    if thread is not None:
        thread.join()


def tls_client(pki: Path, address: str, cert_name: str | None, node_id: str | None = None) -> BrokerClient:
    """A client over TLS to a broker whose CA is PKI/ca.pem, presenting PKI/CERT_NAME.pem
    (mutual TLS), or no certificate when cert_name is None; as node_id (default: the
    certificate's name)."""
    return BrokerClient(address, node_id or cert_name or "anonymous", tls_ca=str(pki / "ca.pem"),
                        tls_cert=str(pki / f"{cert_name}.pem") if cert_name else None,
                        tls_key=str(pki / f"{cert_name}.key") if cert_name else None, rpc_timeout_s=5)


def damaged(raw: bytes, rng: random.Random) -> bytes:
    """`raw` with one to three random changes: a byte changed, bytes cut out, repeated or
    inserted, or a field appended (what a fuzzing peer sends; the wire-reading tests check
    that the broker reads it as protobuf alone does)."""
    from graft_fed.federation.protowire import varint

    data = bytearray(raw)
    for _ in range(rng.choice((1, 1, 2, 3))):
        at = rng.randrange(len(data))
        op = rng.randrange(5)
        if op == 0:
            data[at] = rng.randrange(256)
        elif op == 1:
            del data[at:at + rng.randrange(1, 9)]
        elif op == 2:
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 6)))
        elif op == 3:
            data[at:at] = data[at:at + rng.randrange(1, 40)]
        else:
            data += varint(rng.randrange(1, 20) << 3 | rng.choice((0, 2))) + bytes([rng.randrange(4)]) + b"xyz"[:rng.randrange(4)]
    return bytes(data)


class InformativeStore:
    """A node's trajectory store (its lookup) that holds an informative group (n 2) for every
    prompt and round."""

    def lookup(self, pids, step=None, run_id=None, match="same_step"):
        from graft_fed.core.records import GroupRecord

        return {p: GroupRecord(prompt_id=p, step=step, model_id="m", tokenizer_id="t", problem="q", answer="1",
                               rewards=(1.0, 0.0), advantages=(0.7071, -0.7071), texts=("a", "b"),
                               finish_reasons=("stop", "stop"), lengths=(1, 1), mean_logprobs=(-0.5, -0.25))
                for p in pids}
