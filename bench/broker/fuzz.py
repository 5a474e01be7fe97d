"""Fuzz a mutual-TLS broker with an allowlist the way an attacker with a valid certificate
would: generated and mutated messages across every RPC, sent as raw bytes (the client is
written from the .proto alone, no graft-fed client code on the attacking side), plus the
targeted cases of issue 12. Reports the status codes per RPC and checks that

- no call got INTERNAL, UNKNOWN or DATA_LOSS (a server fault), and the broker logged no
  unexpected exception;
- the broker is still up (an honest node's heartbeat and GetStatus answer);
- the honest nodes' state is unchanged: their sessions, summaries, bundles (bytes),
  matches, reports and their compatibility with each other, and neither is quarantined;
- honest heartbeats were answered promptly while the attacker flooded GetMatches.

    python bench/broker/fuzz.py --messages 100000 [--seed 0] [--threads 4] [--out results/fuzz.json]

Exit status 0 when every check holds. A small run is part of the suite
(tests/federation/test_fuzz.py::test_fuzz_bench_small_run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent import futures
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import grpc  # noqa: E402

FAULTS = ("INTERNAL", "UNKNOWN", "DATA_LOSS")
SERVICE = "graft_fed.v1.Broker"
VERIFIER = "fuzz:parity"  # this module's parity(), importable because bench/broker is on sys.path
N = 2
PROMPTS_PER_ROUND = 8


def rpc_table() -> dict[str, tuple[str, Any, Any]]:
    """method -> (kind, request class, response class), read from the .proto's descriptors
    (the attacker knows the wire contract, nothing of the broker's code)."""
    from google.protobuf import message_factory

    from graft_fed.proto import broker_pb2 as pb

    out = {}
    for m in pb.DESCRIPTOR.services_by_name["Broker"].methods:
        kind = ("stream" if m.client_streaming else "unary") + "_" + ("stream" if m.server_streaming else "unary")
        out[m.name] = (kind, message_factory.GetMessageClass(m.input_type),
                       message_factory.GetMessageClass(m.output_type))
    return out


def parity(response: str, answer: str) -> float:
    """The fuzz federation's verifier: a response is right when its characters' codes sum to
    an odd number (deterministic, instant, no dependency)."""
    return float(sum(map(ord, response)) % 2)


# ------------------------------------------------------------------------------- set-up

def _prompts(directory: Path) -> Path:
    path = directory / "prompts.jsonl"
    path.write_text("".join(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(40)))
    return path


def _pki(directory: Path) -> Path:
    from graft_fed.federation import certs

    return certs.loopback_pki(directory / "certs", "fuzz", ("alice", "bob", "mallory", "outsider"))


class Federation:
    """A broker (in this process), two honest nodes that exchanged a round, and the
    attacker's identities."""

    def __init__(self, work: Path, db: str) -> None:
        from graft_fed.broker.auth import Allowlist
        from graft_fed.broker.config import BrokerConfig
        from graft_fed.broker.server import BrokerServer
        from graft_fed.configbase import from_mapping
        from graft_fed.data.config import DataConfig, load_prompts

        self.pki = _pki(work)
        prompt_file = _prompts(work)
        self.prompts = load_prompts(DataConfig(source=str(prompt_file)))
        allow = work / "allow.yaml"
        for name in ("alice", "bob", "mallory"):
            Allowlist.edit(allow, "add", name)
        cfg = from_mapping(BrokerConfig, {
            "listen": "127.0.0.1:0", "http": "", "db": db if db == ":memory:" else str(work / "broker.sqlite"),
            "tls_cert": str(self.pki / "broker.pem"), "tls_key": str(self.pki / "broker.key"),
            "client_ca": str(self.pki / "ca.pem"), "allowlist": str(allow), "data": {"source": str(prompt_file)},
            "verifier": {"name": VERIFIER}, "seed": 0, "n": N, "prompts_per_round": PROMPTS_PER_ROUND,
            "round_deadline_s": 2.0, "heartbeat_interval_s": 0.5, "offline_after_s": 3600.0, "balance": "none",
            "max_node_bundle_mib": 64,
            # off so that the fuzz reaches the handlers at full speed (the limit itself is tested in
            # tests/federation/test_hostile.py); the publish rate limit stays on
            "max_requests_per_s": 0})
        self.cfg = cfg
        self.server = BrokerServer(cfg).start()
        self.address = f"127.0.0.1:{self.server.port}"
        self.honest = {name: self._client(name) for name in ("alice", "bob")}
        self._honest_round()

    def _client(self, name: str):
        from graft_fed.node.client import BrokerClient

        return BrokerClient(self.address, name, tls_ca=str(self.pki / "ca.pem"),
                            tls_cert=str(self.pki / f"{name}.pem"), tls_key=str(self.pki / f"{name}.key"),
                            rpc_timeout_s=10)

    def manifest(self):
        from graft_fed.federation.manifest import PROTOCOL_VERSION, Manifest, dataset_hash, verifier_version
        from graft_fed.rewards.config import VerifierConfig

        return Manifest(federation_id="", protocol_version=PROTOCOL_VERSION, dataset_id=self.prompts[0].dataset,
                        dataset_hash=dataset_hash(self.prompts), seed=0, n=N, prompts_per_round=PROMPTS_PER_ROUND,
                        mode="", verifier_name=VERIFIER, verifier_version=verifier_version(VerifierConfig(
                            name=VERIFIER)), staleness_rounds=0, advantage="group/sample")

    def record(self, p, model: str):
        from graft_fed.core.advantages import group_advantages
        from graft_fed.core.records import GroupRecord

        import torch

        rewards = (1.0, 0.0)
        adv = tuple(group_advantages(torch.tensor([list(rewards)]))[0].tolist())
        return GroupRecord(prompt_id=p.id, step=0, model_id=model, tokenizer_id="tok", problem=p.problem,
                           answer=p.answer, rewards=rewards, advantages=adv, texts=("y", "x"),  # parity: 1, 0
                           finish_reasons=("stop", "stop"), lengths=(3, 4), mean_logprobs=(-0.5, -0.25))

    def _honest_round(self) -> None:
        from graft_fed.federation.messages import ReportEntry, summarise

        a, b = self.honest["alice"], self.honest["bob"]
        m = self.manifest()
        for c in (a, b):
            c.join(c.node_id, "tok", m, "share_all", 0)
        ps = self.prompts[:4]

        def rows(node, ks):
            return [summarise(node, 0, 0, p.id, [1.0] * k + [0.0] * (N - k), [3, 4], [-0.5, -0.25])
                    for p, k in zip(ps, ks)]
        a.publish(0, rows("alice", [0, 0, 1, 1]))
        b.publish(0, rows("bob", [1, 1, 0, 0]))
        for c, mine in ((a, ps[2:]), (b, ps[:2])):
            for p in mine:
                c.upload(self.record(p, c.node_id), 0)
        for c in (a, b):
            res = c.get_matches(0, 10.0)
            assert res.ready and len(res.offers) == 2, res
            entries = []
            for o in res.offers:
                c.fetch(o.digest, source=o.source_node)
                entries.append(ReportEntry(o.source_node, o.prompt_id, 0.9, 1.0, False))
            c.report(0, entries)
        self.honest_digests = sorted(s.bundle_digest for s in self.server.state.summaries() if s.bundle_digest)

    def honest_state(self) -> dict:
        st, fed = self.server.state, self.server.fed
        names = set(self.honest)
        return {
            "nodes": sorted((n.node_id, n.session_id, n.model_id, n.privacy, n.published) for n in st.list_nodes()
                            if n.node_id in names),
            "summaries": sorted(repr(s) for s in st.summaries() if s.node_id in names),
            "bundles": {d: hashlib.sha256(st.get_bundle(d) or b"").hexdigest() for d in self.honest_digests},
            "matches": sorted(repr(m) for m in st.matches() if m.receiver in names),
            "reports": sorted(repr(r) for r in st.reports() if r.receiver in names),
            "compat": sorted(repr(c) for c in st.compat() if c.source in names and c.receiver in names),
            "quarantined": sorted(fed.quarantined() & names),
        }

    def close(self) -> None:
        for c in self.honest.values():
            c.close()
        self.server.stop()


# ------------------------------------------------------------------------------- generation

INTS = [0, 1, 2, 3, 7, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**53, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 10**12]
FLOATS = [0.0, -0.0, 0.5, 1.0, -1.0, math.sqrt(0.5), math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -1e6,
          1e300, -30.5]


class Attacker:
    """Generates cases: (rpc, identity, payload) with payload bytes, or a list of bytes for
    UploadBundle. Every generated message is built from the descriptors, as a client written
    from the .proto would."""

    def __init__(self, fed: Federation, shared: dict, rng: random.Random) -> None:
        METHODS = rpc_table()
        self.fed, self.shared, self.rng = fed, shared, rng
        session = shared["session"]
        self.methods = METHODS
        self.rpcs = list(METHODS)
        self.prompt_ids = [p.id for p in fed.prompts]
        self.strings = ["", "mallory", "alice", "bob", session, "x" * 64, "x" * 300, "x" * 2000, "\x00", "é" * 10,
                        *self.prompt_ids[:6], *fed.honest_digests, "0" * 64, "f" * 64]

    # ----- values
    def _int(self, field) -> int:
        from google.protobuf.descriptor import FieldDescriptor as F

        r = self.rng
        v = r.choice(INTS) if r.random() < 0.6 else r.randrange(0, 2**r.choice([4, 8, 16, 32, 64]))
        if field.type in (F.TYPE_UINT32, F.TYPE_FIXED32):
            return v % 2**32
        if field.type in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32, F.TYPE_ENUM):
            return (v % 2**32) - 2**31 if v >= 2**31 else v
        if field.type in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
            return (v % 2**64) - 2**63 if v >= 2**63 else v
        return v % 2**64

    def _str(self) -> str:
        r = self.rng
        if r.random() < 0.7:
            return r.choice(self.strings)
        return "".join(chr(r.choice([r.randrange(32, 127), r.randrange(0x80, 0x3000)])) for _ in range(r.randrange(40)))

    def _tag(self):
        from graft_fed.proto import broker_pb2 as pb

        r = self.rng
        if r.random() < 0.8:
            return pb.RequestTag(request_id="%032x" % r.getrandbits(128), sent_at_ms=int(time.time() * 1000))
        return pb.RequestTag(request_id=self._str(), sent_at_ms=self._int(pb.RequestTag.DESCRIPTOR.fields[1]))

    def _summary(self):
        from graft_fed.proto import broker_pb2 as pb

        r = self.rng
        k = r.choice([0, 1, 2, 3])
        s = pb.GroupSummary(prompt_id=r.choice(self.prompt_ids), round=r.choice([0, 0, 1, 2]), policy_version=0, n=N,
                            k=k, reward_mean=k / N, reward_std=[0.0, math.sqrt(0.5), 0.0, 0.0][k],
                            lengths=[3, 4], mean_logprobs=[-0.5, -0.25])
        if r.random() < 0.5:  # break one thing
            name = r.choice(["k", "n", "reward_mean", "reward_std", "lengths", "mean_logprobs", "bundle_digest",
                             "round", "policy_version", "prompt_id"])
            field = pb.GroupSummary.DESCRIPTOR.fields_by_name[name]
            s.ClearField(name)
            if field.is_repeated:
                getattr(s, name).extend(self._value(field, 1) for _ in range(r.choice([0, 1, 3, 50])))
            else:
                setattr(s, name, self._value(field, 1))
        return s

    def _value(self, field, depth: int) -> Any:
        from google.protobuf.descriptor import FieldDescriptor as F

        r = self.rng
        if field.type == F.TYPE_MESSAGE:
            if field.message_type.name == "RequestTag":
                return self._tag()
            if field.message_type.name == "GroupSummary" and r.random() < 0.7:
                return self._summary()
            if field.message_type.name == "Manifest" and r.random() < 0.6:
                from graft_fed.federation.codec import manifest_to_pb

                m = manifest_to_pb(self.fed.manifest())
                if r.random() < 0.5:
                    f = r.choice(m.DESCRIPTOR.fields)
                    setattr(m, f.name, self._value(f, depth + 1))
                return m
            return self.message(field.message_type._concrete_class, depth + 1)
        if field.type == F.TYPE_STRING:
            if field.name == "node_id":
                return "mallory" if r.random() < 0.75 else self._str()
            if field.name == "session_id":
                return self.shared["session"] if r.random() < 0.75 else self._str()
            if field.name == "prompt_id" and r.random() < 0.6:
                return r.choice(self.prompt_ids)
            return self._str()
        if field.type == F.TYPE_BYTES:
            return r.randbytes(r.choice([0, 1, 8, 64, 300]))
        if field.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
            v = r.choice(FLOATS) if r.random() < 0.6 else r.uniform(-2, 2)
            return v if field.type == F.TYPE_DOUBLE or not math.isfinite(v) or abs(v) < 3e38 else 1.0
        if field.type == F.TYPE_BOOL:
            return r.random() < 0.5
        if field.name == "wait_ms":
            return r.choice([0, 0, 10, 50]) if r.random() < 0.97 else r.choice([2000, 2**32 - 1])
        if field.name in ("round", "source_round") and r.random() < 0.5:
            return r.choice([0, 0, 1, 2])
        return self._int(field)

    def message(self, cls, depth: int = 0) -> Any:
        msg = cls()
        for field in cls.DESCRIPTOR.fields:
            if depth > 3 or self.rng.random() < 0.25:
                continue
            if field.is_repeated:
                count = self.rng.choice([0, 1, 1, 2, 3, 8, 40])
                values = [self._value(field, depth) for _ in range(count)]
                getattr(msg, field.name).extend(values)
            elif field.type == field.TYPE_MESSAGE:
                getattr(msg, field.name).CopyFrom(self._value(field, depth))
            else:
                setattr(msg, field.name, self._value(field, depth))
        return msg

    # ----- mutation
    def mutate(self, data: bytes) -> bytes:
        r = self.rng
        buf = bytearray(data)
        for _ in range(r.choice([1, 1, 2, 3, 6])):
            op = r.randrange(8)
            pos = r.randrange(len(buf) + 1)
            if op == 0 and buf:
                i = r.randrange(len(buf))
                buf[i] ^= 1 << r.randrange(8)
            elif op == 1 and buf:
                buf[r.randrange(len(buf))] = r.randrange(256)
            elif op == 2:
                del buf[pos:pos + r.randrange(1, 16)]
            elif op == 3:
                buf[pos:pos] = r.randbytes(r.randrange(1, 16))
            elif op == 4:
                del buf[pos:]
            elif op == 5 and buf:
                j = r.randrange(len(buf))
                buf[pos:pos] = buf[j:j + r.randrange(1, 32)]
            elif op == 6:  # an unknown or repeated field: varint key, then a value of some wire type
                key = (r.randrange(1, 40) << 3) | r.choice([0, 1, 2, 5])
                buf += bytes([key & 0x7F]) + r.randbytes(r.randrange(0, 12))
            else:  # an interesting varint where a varint field may be
                v = r.choice(INTS)
                enc = bytearray()
                while True:
                    b, v = v & 0x7F, v >> 7
                    enc.append(b | (0x80 if v else 0))
                    if not v:
                        break
                buf[pos:pos] = bytes([r.choice([0x08, 0x10, 0x18, 0x20, 0x28, 0x30])]) + bytes(enc)
        return bytes(buf)

    def case(self) -> tuple[str, str, Any]:
        r = self.rng
        rpc = r.choice(self.rpcs)
        kind, req_cls, _ = self.methods[rpc]
        who = "outsider" if r.random() < 0.05 else "mallory"
        style = r.random()

        def one() -> bytes:
            if style < 0.08:
                return r.randbytes(r.randrange(0, 200))
            data = self.message(req_cls).SerializeToString()
            return self.mutate(data) if style < 0.5 else data
        if kind == "stream_unary":
            return rpc, who, [one() for _ in range(r.choice([1, 1, 2, 3]))]
        return rpc, who, one()


def targeted(fed: Federation, session: str) -> list[tuple[str, str, Any]]:
    """The cases of issue 12, and their neighbours, as raw bytes."""
    from graft_fed.federation.bundles import digest_of
    from graft_fed.federation.codec import manifest_to_pb
    from graft_fed.proto import broker_pb2 as pb

    def tag():
        return pb.RequestTag(request_id="%032x" % random.getrandbits(128), sent_at_ms=int(time.time() * 1000))
    m = manifest_to_pb(fed.manifest())
    p = fed.prompts
    out: list[tuple[str, str, Any]] = []

    def add(rpc, msg, who="mallory"):
        out.append((rpc, who, [x.SerializeToString() for x in msg] if isinstance(msg, list) else
                    msg.SerializeToString()))
    big_m = pb.Manifest()
    big_m.CopyFrom(m)
    big_m.dataset_id = "d" * (4 * 2**20)
    add("Join", pb.JoinRequest(node_id="mallory", model_id="m", tokenizer_id="t" * (8 * 2**20), manifest=m,
                               privacy=1, tag=tag()))
    add("Join", pb.JoinRequest(node_id="mallory", model_id="m", tokenizer_id="t", manifest=big_m, privacy=1, tag=tag()))
    add("Join", pb.JoinRequest(node_id="mallory", model_id="m", tokenizer_id="t", manifest=m, privacy=1,
                               resume_round=2**63, tag=tag()))
    for rnd in (2**63, 2**64 - 1, 10**12):
        add("Heartbeat", pb.HeartbeatRequest(node_id="mallory", session_id=session, round=rnd, tag=tag()))
        add("GetMatches", pb.MatchRequest(node_id="mallory", session_id=session, round=rnd, wait_ms=10))
        add("ReportCompatibility", pb.CompatibilityReport(node_id="mallory", session_id=session, round=rnd, tag=tag()))
    s = pb.GroupSummary(prompt_id=p[0].id, round=0, policy_version=2**63, n=N, k=1, reward_mean=0.5,
                        reward_std=math.sqrt(0.5), lengths=[3, 4], mean_logprobs=[-0.5, -0.25])
    add("PublishSummaries", pb.PublishRequest(node_id="mallory", session_id=session, round=0, summaries=[s], tag=tag()))
    for change in (dict(reward_std=5.0), dict(bundle_digest="a" * 64), dict(mean_logprobs=[-1e6, -1e6]),
                   dict(k=2, reward_mean=1.0, reward_std=0.0, bundle_digest=fed.honest_digests[0])):
        s2 = pb.GroupSummary(prompt_id=p[10].id, round=0, policy_version=0, n=N, k=1, reward_mean=0.5,
                             reward_std=math.sqrt(0.5), lengths=[3, 4], mean_logprobs=[-0.5, -0.25])
        for k, v in change.items():
            if isinstance(v, list):
                getattr(s2, k)[:] = v
            else:
                setattr(s2, k, v)
        add("PublishSummaries", pb.PublishRequest(node_id="mallory", session_id=session, round=0, summaries=[s2],
                                                  tag=tag()))
    add("PublishSummaries", pb.PublishRequest(node_id="mallory", session_id=session, round=0,
                                              summaries=[s] * 300, tag=tag()))
    entry = pb.CompatibilityReport.Entry(source_node_id="alice", prompt_id=p[0].id, rejected=True)
    for count in (300_000, 5000, 40):
        add("ReportCompatibility", pb.CompatibilityReport(node_id="mallory", session_id=session, round=0,
                                                          entries=[entry] * count, tag=tag()))
    for payload in (b"[" * 300_000 + b"]" * 300_000, b'{"step":' + b"9" * 5000 + b"}", b'{"step":1e999}',
                    b'{"step":NaN}', b"\xc3\x28"):
        add("UploadBundle", [pb.BundleChunk(digest=digest_of(payload), total_size=len(payload), offset=0,
                                            data=payload[:1024 * 1024], node_id="mallory", session_id=session,
                                            prompt_id=p[0].id, round=0, tag=tag())])
    add("UploadBundle", [pb.BundleChunk(digest="0" * 64, total_size=1, offset=0, data=b"x", node_id="alice",
                                        session_id=session, prompt_id=p[0].id, round=0, tag=tag())])
    add("UploadBundle", [pb.BundleChunk(digest="0" * 64, total_size=2**63 - 1, offset=0, data=b"x",
                                        node_id="mallory", session_id=session, prompt_id=p[0].id, round=0, tag=tag())])
    for d in fed.honest_digests:
        add("FetchBundle", pb.FetchBundleRequest(node_id="mallory", session_id=session, digest=d))
    add("GetStatus", pb.StatusRequest(), who="outsider")
    add("HasBundles", pb.HasBundlesRequest(node_id="mallory", session_id=session, digests=["0" * 64] * 5000))
    return out


# ------------------------------------------------------------------------------- sending

class Sender:
    def __init__(self, fed: Federation) -> None:
        from graft_fed.federation.transport import channel_credentials, grpc_options

        self.channels = {}
        for who in ("mallory", "outsider"):
            creds = channel_credentials(str(fed.pki / "ca.pem"), str(fed.pki / f"{who}.pem"),
                                        str(fed.pki / f"{who}.key"))
            self.channels[who] = grpc.secure_channel(fed.address, creds, options=grpc_options(16))
        METHODS = rpc_table()
        self.calls: dict[tuple[str, str], Callable] = {}
        for who, ch in self.channels.items():
            for rpc, (kind, _, _) in METHODS.items():
                path = f"/{SERVICE}/{rpc}"
                self.calls[(who, rpc)] = getattr(ch, kind)(path, request_serializer=None, response_deserializer=None)
        self.kinds = {rpc: kind for rpc, (kind, _, _) in METHODS.items()}

    def send(self, rpc: str, who: str, payload: Any, timeout: float = 5.0, shared: dict | None = None) -> str:
        """The status code's name; a successful Join's session goes into `shared` (the
        attacker keeps acting in its newest session, as a real one would)."""
        call = self.calls[(who, rpc)]
        try:
            kind = self.kinds[rpc]
            if kind == "stream_unary":
                call(iter(payload), timeout=timeout)
            elif kind == "unary_stream":
                for _ in call(payload, timeout=timeout):
                    pass
            else:
                resp = call(payload, timeout=timeout)
                if rpc == "Join" and shared is not None:
                    from graft_fed.proto import broker_pb2 as pb

                    shared["session"] = pb.JoinResponse.FromString(resp).session_id
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()


class ErrorCounter(logging.Handler):
    """Counts the broker's own unexpected-exception log lines (log.exception in the servicer)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0
        self.samples: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if len(self.samples) < 5:
            self.samples.append(self.format(record)[:2000])


def run(messages: int, seed: int = 0, threads: int = 4, db: str = "sqlite", work: Path | None = None,
        flood: int = 80, progress: bool = False) -> dict:
    """Run the fuzz; returns the results (see the module docstring); `ok` says whether every
    check held."""
    rng = random.Random(seed)
    random.seed(seed)
    tmp = tempfile.TemporaryDirectory() if work is None else None
    work = Path(tmp.name) if tmp is not None else work
    errors = ErrorCounter()
    broker_log = logging.getLogger("graft_fed.broker")
    saved = broker_log.level, broker_log.propagate
    broker_log.setLevel(logging.ERROR)  # the broker's own warnings about refused input are expected
    broker_log.propagate = False
    broker_log.addHandler(errors)
    fed = Federation(work, ":memory:" if db == "memory" else "sqlite")
    sender = Sender(fed)
    try:
        from graft_fed.node.client import BrokerClient  # noqa: F401 - only to join mallory below

        mallory = fed._client("mallory")
        mallory.join("mallory", "tok", fed.manifest(), "share_all", 0)
        session = mallory.session
        mallory._stop_heartbeats()
        before = fed.honest_state()
        codes: Counter[tuple[str, str]] = Counter()
        lock = threading.Lock()
        cases = targeted(fed, session)
        t0 = time.perf_counter()

        # 1. a GetMatches flood from one node while an honest node heartbeats
        from graft_fed.proto import broker_pb2 as pb

        mallory.publish(1, [pb.GroupSummary(prompt_id=fed.prompts[20].id, round=1, policy_version=0, n=N, k=0,
                                            reward_mean=0.0, reward_std=0.0, lengths=[3, 4],
                                            mean_logprobs=[-0.5, -0.25])])
        poll = pb.MatchRequest(node_id="mallory", session_id=session, round=1, wait_ms=2000).SerializeToString()
        worst_hb = 0.0
        with futures.ThreadPoolExecutor(max(1, flood)) as pool:
            jobs = [pool.submit(sender.send, "GetMatches", "mallory", poll, 10.0) for _ in range(flood)]
            time.sleep(0.3)
            alice = fed.honest["alice"]
            for _ in range(5):
                h0 = time.perf_counter()
                alice.stub.Heartbeat(pb.HeartbeatRequest(node_id="alice", session_id=alice.session, round=0,
                                                         tag=_tag()), timeout=10)
                worst_hb = max(worst_hb, time.perf_counter() - h0)
            for j in jobs:
                codes[("GetMatches(flood)", j.result())] += 1

        # 2. targeted cases, then generated and mutated messages, on `threads` workers
        for rpc, who, payload in cases:
            codes[(rpc, sender.send(rpc, who, payload, 30.0))] += 1
        remaining = max(0, messages - len(cases) - flood)
        per_worker = [remaining // threads + (1 if i < remaining % threads else 0) for i in range(threads)]
        done = [0]

        shared = {"session": session}
        from graft_fed.federation.codec import manifest_to_pb

        def rejoin() -> bytes:
            return pb.JoinRequest(node_id="mallory", model_id="m", tokenizer_id="tok",
                                  manifest=manifest_to_pb(fed.manifest()), privacy=1, tag=_tag()).SerializeToString()

        def worker(i: int, count: int) -> None:
            attacker = Attacker(fed, shared, random.Random(rng.random() + i))
            local: Counter[tuple[str, str]] = Counter()
            lost = 0
            for _ in range(count):
                if lost >= 20:  # its session ended (a fuzzed Join or Leave): join again, counted too
                    rpc, who, payload = "Join", "mallory", rejoin()
                    lost = 0
                else:
                    rpc, who, payload = attacker.case()
                code = sender.send(rpc, who, payload, shared=shared)
                lost += code == "UNAUTHENTICATED"
                local[(rpc, code)] += 1
                with lock:
                    done[0] += 1
                    if progress and done[0] % 5000 == 0:
                        print(f"  {done[0]} / {remaining} messages, {time.perf_counter() - t0:.0f}s", flush=True)
            with lock:
                codes.update(local)
        with futures.ThreadPoolExecutor(threads) as pool:
            for f in [pool.submit(worker, i, c) for i, c in enumerate(per_worker)]:
                f.result()
        elapsed = time.perf_counter() - t0

        # 3. the checks
        alive = True
        try:
            alice = fed.honest["alice"]
            alice.stub.Heartbeat(pb.HeartbeatRequest(node_id="alice", session_id=alice.session, round=0, tag=_tag()),
                                 timeout=10)
            alice.status()
        except Exception as exc:  # noqa: BLE001 - reported
            alive = False
            print(f"broker not answering: {exc}", file=sys.stderr)
        after = fed.honest_state()
        changed = sorted(k for k in before if before[k] != after[k])
        by_code: Counter[str] = Counter()
        by_rpc: dict[str, dict[str, int]] = {}
        for (rpc, code), v in codes.items():
            by_code[code] += v
            by_rpc.setdefault(rpc, {})[code] = by_rpc.setdefault(rpc, {}).get(code, 0) + v
        server_codes: Counter[str] = Counter()
        for (_, code), v in fed.server.servicer.stats.calls.items():
            server_codes[code] += v
        faults = {c: by_code.get(c, 0) for c in FAULTS}
        server_faults = {c: server_codes.get(c, 0) for c in FAULTS}
        res = {
            "messages": sum(codes.values()), "targeted_cases": len(cases), "flood": flood, "seed": seed,
            "threads": threads, "db": db, "seconds": round(elapsed, 1),
            "codes": dict(sorted(by_code.items())), "by_rpc": {k: dict(sorted(v.items())) for k, v in
                                                               sorted(by_rpc.items())},
            "faults": faults, "server_faults": server_faults, "broker_error_logs": errors.count,
            "broker_error_samples": errors.samples, "broker_up": alive, "honest_state_changed": changed,
            "honest_heartbeat_worst_s_during_flood": round(worst_hb, 3),
        }
        res["ok"] = (alive and not changed and not any(faults.values()) and not any(server_faults.values())
                     and errors.count == 0 and worst_hb < 1.0)
        return res
    finally:
        broker_log.removeHandler(errors)
        broker_log.setLevel(saved[0])
        broker_log.propagate = saved[1]
        sender.close()
        fed.close()
        if tmp is not None:
            tmp.cleanup()


def _tag():
    from graft_fed.node.client import new_tag

    return new_tag()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--db", choices=("sqlite", "memory"), default="sqlite")
    ap.add_argument("--flood", type=int, default=80, help="concurrent GetMatches long-polls from the attacker")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.CRITICAL)
    res = run(args.messages, args.seed, args.threads, args.db, flood=args.flood, progress=True)
    print(f"{res['messages']} messages ({res['targeted_cases']} targeted, {res['flood']} flood) in {res['seconds']}s "
          f"against a mutual-TLS broker with an allowlist ({res['db']})")
    print("status codes:", ", ".join(f"{k} {v}" for k, v in res["codes"].items()))
    for rpc, codes in res["by_rpc"].items():
        print(f"  {rpc:<22} " + ", ".join(f"{k} {v}" for k, v in codes.items()))
    print(f"INTERNAL/UNKNOWN/DATA_LOSS: client saw {res['faults']}, broker counted {res['server_faults']}, "
          f"broker error log lines {res['broker_error_logs']}")
    print(f"broker up: {res['broker_up']}; honest state changed: {res['honest_state_changed'] or 'nothing'}; "
          f"worst honest heartbeat during the flood: {res['honest_heartbeat_worst_s_during_flood']}s")
    for s in res["broker_error_samples"]:
        print("broker error:", s)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")
    print("OK" if res["ok"] else "FAILED")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
