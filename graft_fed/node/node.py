"""A federation node: a learner (built like `train`'s, so it runs sharded under torchrun)
whose peers are the broker (graft_fed/node/peers.py), stepping with the GRAFT step written
once in graft_fed/graft/step.py.

    torchrun --nproc-per-node K -m graft_fed.cli node --config X   # one node on K GPUs
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from graft_fed.configbase import load_config, require, require_address
from graft_fed.core.advantages import advantage_id
from graft_fed.errors import ConfigError, GraftFedError
from graft_fed.federation.certcheck import JoinTracker, check_node_certificate, track_joins, wait_for_first_join
from graft_fed.federation.manifest import PROTOCOL_VERSION, Manifest, dataset_hash, verifier_version
from graft_fed.federation.messages import Privacy
from graft_fed.graft import step as graft_step
from graft_fed.node.client import BrokerClient
from graft_fed.node.live import attach_live_scalars
from graft_fed.node.peers import BrokerPeers
from graft_fed.node.secret import load_or_create
from graft_fed.trainer.config import TrainConfig
from graft_fed.trainer.distributed import make_trainer

log = logging.getLogger("graft_fed.node")


@dataclass(frozen=True)
class FederationSection:
    """How this node takes part in a federation."""

    #: The broker's address, HOST:PORT.
    broker: str = "127.0.0.1:50551"
    #: This node's name in the federation (default: run.name).
    node_id: str = ""
    #: What may leave the site: "share_all" (every informative group's trajectories go to
    #: the broker, so peers joining later can learn from them), "matched_only" (only groups
    #: a receiver was matched to), "summaries_only" (no trajectories ever; still receives).
    privacy: str = "share_all"
    #: Refuse a broker whose federation id differs (null = accept any).
    federation_id: str | None = None
    #: The federation CA (PEM) that signed the broker's certificate: turns TLS on.
    tls_ca: str | None = None
    #: This node's certificate and key for mutual TLS (its identity is the certificate's name).
    tls_cert: str | None = None
    tls_key: str | None = None
    #: Refuse peer bundles whose producer's signature does not check out against tls_ca (the
    #: certificate must be the CA's and name the source node; docs/security.md). null = yes
    #: when this node uses mutual TLS (then it also signs its own bundles); false accepts
    #: unsigned bundles (logged once, counted as federation/unsigned_bundles) but still
    #: refuses a signature that fails.
    require_signatures: bool | None = None
    #: The federation CA's list of revoked certificates (the revoked.json `graft-fed certs
    #: revoke` writes, copied here as the CA is): a peer bundle signed with a listed
    #: certificate is refused and reported, even one signed before the revocation. Re-read
    #: when the file changes; a file that turns bad keeps the last good list. Needs tls_ca.
    revoked_certs: str | None = None
    #: Allow plaintext gRPC to a non-loopback broker (logged as a warning at every start).
    insecure: bool = False
    #: Longest single long-poll for matches, seconds.
    match_wait_s: float = 10.0
    #: Give up the exchange of one step after this long and train plain GRPO.
    round_timeout_s: float = 180.0
    #: Wait at most this long for matched sources to upload their bundles.
    fetch_timeout_s: float = 30.0
    #: Deadline of ordinary RPCs, seconds.
    rpc_timeout_s: float = 10.0
    #: Largest gRPC message, MiB (keep equal to the broker's).
    max_message_mib: int = 16
    #: Bundle chunk size, KiB (at most the broker's).
    chunk_kib: int = 1024
    #: Largest peer bundle this node fetches, MiB (a fetch announced larger is cut off before
    #: it is buffered, so a hostile broker cannot make the node hold without end). Keep it at
    #: or above the broker's max_bundle_mib: a larger bundle is skipped and reported as
    #: undelivered (not as a rejection of its source).
    max_bundle_mib: int = 64
    #: Reconnection backoff: first delay and cap, seconds (full jitter).
    reconnect_min_s: float = 1.0
    reconnect_max_s: float = 60.0
    #: matched_only: the most rounds back an asynchronous broker may ask this node to upload
    #: one of its groups from. The broker's staleness_rounds decides the window; one above
    #: this is capped to it (logged at join), so a hostile broker cannot widen the window to
    #: every round the node ever recorded.
    max_staleness_rounds: int = 16

    def __post_init__(self) -> None:
        require_address(self.broker, "federation.broker", port_zero=False)
        require(self.privacy in Privacy.names(), f"federation.privacy must be one of {', '.join(Privacy.names())}")
        for key in ("match_wait_s", "round_timeout_s", "rpc_timeout_s", "reconnect_min_s", "reconnect_max_s"):
            value = getattr(self, key)
            require(0 < value <= 86400, f"federation.{key} must be seconds > 0 and at most a day, got {value}")
        require(0 <= self.fetch_timeout_s <= 86400,
                f"federation.fetch_timeout_s must be seconds >= 0 and at most a day, got {self.fetch_timeout_s}")
        require(self.reconnect_min_s <= self.reconnect_max_s, "need reconnect_min_s <= reconnect_max_s")
        require(isinstance(self.max_staleness_rounds, int) and not isinstance(self.max_staleness_rounds, bool)
                and 0 <= self.max_staleness_rounds < 2**31,
                f"federation.max_staleness_rounds must be a whole number of rounds >= 0, got "
                f"{self.max_staleness_rounds!r}")
        require(1 <= self.max_message_mib <= 1024,
                f"federation.max_message_mib must be in [1, 1024] (keep it equal to the broker's), "
                f"got {self.max_message_mib}")
        require(16 <= self.chunk_kib <= 1024 * self.max_message_mib // 2,
                "federation.chunk_kib must be >= 16 (the broker refuses smaller non-final upload chunks) and at "
                f"most half of max_message_mib, got {self.chunk_kib}")
        require(isinstance(self.max_bundle_mib, int) and not isinstance(self.max_bundle_mib, bool)
                and 1 <= self.max_bundle_mib <= 65536,
                f"federation.max_bundle_mib must be a whole number of MiB in [1, 65536], got {self.max_bundle_mib!r}")
        require((self.tls_cert is None) == (self.tls_key is None), "federation: give both tls_cert and tls_key")
        require(self.tls_cert is None or self.tls_ca is not None,
                "federation.tls_cert needs federation.tls_ca (the CA that signed the broker's certificate)")
        require(not self.require_signatures or self.tls_ca is not None,
                "federation.require_signatures needs federation.tls_ca (the federation CA) to check signatures")
        require(self.revoked_certs is None or self.tls_ca is not None,
                "federation.revoked_certs needs federation.tls_ca: revocations are checked on bundle signatures")


@dataclass(frozen=True)
class NodeConfig(TrainConfig):
    """A node: a training run plus its federation section."""

    federation: FederationSection = field(default_factory=FederationSection)

    def train_config(self) -> TrainConfig:
        return TrainConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(TrainConfig)})

    @property
    def node_id(self) -> str:
        return self.federation.node_id or self.run.name


def load_node_config(path: str | Path | None, overrides: Mapping[str, Any] | None = None) -> NodeConfig:
    return load_config(NodeConfig, path, overrides, "node config")


class Node:
    """One federation node: its learner, its broker client, and the broker as its peers."""

    def __init__(self, cfg: NodeConfig, resume: str | None = None, quiet: bool = False) -> None:
        f = cfg.federation
        # before loading anything: a certificate the broker would refuse is a one-line error now
        check_node_certificate(cfg.node_id, f.tls_ca, f.tls_cert, f.tls_key)
        self.cfg = cfg
        self.quiet = quiet
        self.trainer = make_trainer(cfg.train_config(), resume=resume, quiet=True)
        t = self.trainer
        # Under torchrun only the main process talks to the broker (peers.py).
        self.client = BrokerClient(f.broker, cfg.node_id, max_message_mib=f.max_message_mib,
                                   rpc_timeout_s=f.rpc_timeout_s, chunk_kib=f.chunk_kib, tls_ca=f.tls_ca,
                                   tls_cert=f.tls_cert, tls_key=f.tls_key, insecure=f.insecure,
                                   require_signatures=f.require_signatures, revoked_certs=f.revoked_certs,
                                   max_bundle_mib=f.max_bundle_mib) if t.is_main else None
        manifest = Manifest(
            federation_id=f.federation_id or "", protocol_version=PROTOCOL_VERSION,
            dataset_id=t.schedule.prompts[0].dataset, dataset_hash=dataset_hash(t.schedule.prompts),
            seed=cfg.run.prompt_schedule_seed, n=cfg.rollout.n, prompts_per_round=cfg.algorithm.prompts_per_step,
            mode="", verifier_name=cfg.verifier.name, verifier_version=verifier_version(cfg.verifier),
            staleness_rounds=0, advantage=advantage_id(cfg.algorithm.scale_rewards, cfg.algorithm.std))
        self.peers = BrokerPeers(self.client, cfg.node_id, f.privacy, manifest, broker=f.broker,  # type: ignore[arg-type]
                                 federation_id=f.federation_id, match_wait_s=f.match_wait_s,
                                 round_timeout_s=f.round_timeout_s, fetch_timeout_s=f.fetch_timeout_s,
                                 rpc_timeout_s=f.rpc_timeout_s, reconnect_min_s=f.reconnect_min_s,
                                 reconnect_max_s=f.reconnect_max_s, max_staleness_rounds=f.max_staleness_rounds,
                                 node_secret=load_or_create(cfg.run.output_dir) if t.is_main else "")

    # the connection's state lives in the peers; these name it for operators and tests
    @property
    def backlog(self):  # type: ignore[no-untyped-def]
        return self.peers.backlog

    @property
    def backoff(self):  # type: ignore[no-untyped-def]
        return self.peers.backoff

    def ensure_joined(self) -> bool:
        return self.trainer.is_main and self.peers.ensure_joined(self.trainer)

    def connect(self, join_timeout_s: float) -> None:
        """Join the broker before the first, long, rollout, and feed its live page. A node that
        cannot join within `join_timeout_s` raises the likely cause (NeverJoinedError, exit 2);
        0 trains alone until the broker answers, the degraded mode a broker outage that
        begins later also leads to. Under torchrun the main process joins and every process
        stops together, or none does."""
        never_joined: GraftFedError | None = None
        if self.client is not None:
            attach_live_scalars(self)  # learning curves on the broker's live page
            f = self.cfg.federation
            tracker = JoinTracker(f.broker, self.cfg.node_id, tls=f.tls_ca is not None,
                                  client_cert=f.tls_cert is not None)
            track_joins(self.client, tracker)
            try:
                if join_timeout_s:
                    wait_for_first_join(self.ensure_joined, tracker, join_timeout_s)
                else:
                    self.ensure_joined()
            except GraftFedError as exc:
                never_joined = exc
        reason = self.trainer.from_main(str(never_joined) if never_joined else None)
        if never_joined is not None:
            raise never_joined
        if reason:
            raise ConfigError(reason)

    def close(self, leave: bool = True) -> None:
        if self.client is not None:
            if leave:
                self.peers.leave()
            self.client.close()
        self.trainer.close()

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def train_step(self) -> dict[str, Any]:
        return graft_step.step(self.trainer, self.peers)

    def train(self, evaluate_before_after: bool = True) -> dict[str, Any]:
        self.ensure_joined()  # join (and start heartbeats) before the first, long, rollout
        self.trainer.quiet = self.quiet or not self.trainer.is_main
        return self.trainer.train(evaluate_before_after, step_fn=self.train_step)
