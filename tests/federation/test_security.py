"""Transport security and identity: mutual TLS on loopback with a throwaway CA."""

import grpc
import pytest

from graft_fed.broker.auth import Allowlist
from graft_fed.errors import ConfigError
from graft_fed.federation import certs
from graft_fed.federation.transport import check_plaintext, is_loopback
from graft_fed.node.client import BrokerClient
from graft_fed.proto import broker_pb2 as pb
from tests.federation.helpers import broker_config, start_broker, stop_heartbeats, tls_client
from tests.federation.test_broker_rpc import code_of, manifest, summary


@pytest.fixture()
def pki(tmp_path):
    return certs.loopback_pki(tmp_path / "certs", "test", ("alice", "bob", "mallory"))


@pytest.fixture()
def prompts(prompt_file):
    from graft_fed.data.config import DataConfig, load_prompts

    return load_prompts(DataConfig(source=str(prompt_file)))


@pytest.mark.parametrize("front", [False, True], ids=["grpc-in-broker", "front-process"])
def test_mutual_tls_identity_allowlist_and_revocation(pki, prompt_file, prompts, tmp_path, front):
    """Also with the front process (broker/front.py), which ends TLS and hands the broker
    the client certificate's name and PEM."""
    allow = tmp_path / "allow.yaml"
    Allowlist.edit(allow, "add", "alice")
    Allowlist.edit(allow, "add", "mallory")
    broker = start_broker(broker_config(prompt_file, tls_cert=str(pki / "broker.pem"), tls_key=str(pki / "broker.key"),
                                        client_ca=str(pki / "ca.pem"), allowlist=str(allow), front_process=front))
    try:
        alice = tls_client(pki, broker.address, "alice")
        alice.join("alice", "tok", manifest(prompts), "share_all", 0, node_secret="1" * 64)
        # the certificate proves alice: a Join with another node secret (alice on a new
        # machine, without her old run folder) is hers, and her secret follows her
        alice.join("alice", "tok", manifest(prompts), "share_all", 0, node_secret="2" * 64)
        assert alice.publish(0, [summary(prompts[0], 1)]) == (1, 0)

        # mallory holds a valid certificate but claims to be alice: refused, whatever she fills in
        mallory = tls_client(pki, broker.address, "mallory", node_id="alice")
        code, details = code_of(lambda: mallory.join("alice", "tok", manifest(prompts), "share_all", 0))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "cannot act as node 'alice'" in details

        # bob's certificate is valid but he is not on the allowlist
        bob = tls_client(pki, broker.address, "bob")
        code, _ = code_of(lambda: bob.join("bob", "tok", manifest(prompts), "share_all", 0))
        assert code == grpc.StatusCode.PERMISSION_DENIED

        # no client certificate: the TLS handshake itself fails
        anon = tls_client(pki, broker.address, None, node_id="alice")
        code, _ = code_of(lambda: anon.join("alice", "tok", manifest(prompts), "share_all", 0))
        assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)

        # plaintext to a TLS broker does not get through either
        plain = BrokerClient(broker.address, "alice", rpc_timeout_s=3)
        assert code_of(lambda: plain.publish(0, [summary(prompts[1], 1)]))[0] == grpc.StatusCode.UNAVAILABLE

        # revocation takes effect at the next call, a heartbeat cannot revive the node
        Allowlist.edit(allow, "revoke", "alice")
        code, details = code_of(lambda: alice.publish(0, [summary(prompts[2], 1)]))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "revoked" in details
        code, _ = code_of(lambda: alice.stub.Heartbeat(pb.HeartbeatRequest(node_id="alice", session_id=alice.session,
                                                                           round=1), timeout=5))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        for c in (alice, mallory, bob, anon, plain):
            c.close()
    finally:
        broker.stop()


def test_plaintext_only_on_loopback_or_explicitly_insecure(caplog):
    assert is_loopback("127.0.0.1:5") and is_loopback("localhost:5") and is_loopback("[::1]:5")
    assert not is_loopback("10.0.0.2:5") and not is_loopback("broker.example.org:5")
    check_plaintext("127.0.0.1:50551", False, "broker")
    with pytest.raises(ConfigError, match="not a loopback address"):
        check_plaintext("0.0.0.0:50551", False, "broker")
    with pytest.raises(ConfigError, match="not a loopback address"):
        BrokerClient("broker.example.org:50551", "n")
    check_plaintext("0.0.0.0:50551", True, "broker")
    assert "INSECURE" in caplog.text


def test_certificate_tooling_errors(tmp_path):
    with pytest.raises(ConfigError, match="holds no CA"):
        certs.issue(tmp_path / "none", "alice")
    certs.init_ca(tmp_path / "ca")
    with pytest.raises(ConfigError, match="already holds a CA"):
        certs.init_ca(tmp_path / "ca")
    with pytest.raises(ConfigError, match="certificate name"):
        certs.issue(tmp_path / "ca", "bad name/../x")
    certs.issue(tmp_path / "ca", "alice")
    assert (tmp_path / "ca" / "alice.key").stat().st_mode & 0o777 == 0o600
    assert certs.revoke(tmp_path / "ca", "alice")["name"] == "alice"


# The operator's allowlist file: a value that is not a list of names is refused, not read as
# letters; a bad file at start stops the broker; a bad edit while serving keeps the last
# good list in force (never INTERNAL, never parsed more than once per version).

BAD_ALLOWLISTS = [
    # (file text, what the ConfigError must say)
    (b"allowed: [alice, mallory]\nrevoked: mallory\n", ["`revoked` is the single value 'mallory'",
                                                        "revoked: [mallory]"]),
    (b"allowed: alice\n", ["`allowed` is the single value 'alice'", "allowed: [alice]"]),
    (b"trusted: alice\n", ["`trusted` is the single value", "trusted: [alice]"]),
    (b"revoked: {mallory: yes}\n", ["`revoked` is a mapping"]),
    (b"allowed: [alice, 007]\n", ["entry 2 of `allowed`", "'007'", "a number", "quote it"]),
    (b"allowed:\n  - alice\n  - yes\n", ["line 3", "entry 2 of `allowed`", "'yes'", "quote it"]),
    (b"allowed: [alice\nrevoked: [mallory]\n", ["not valid YAML", "line 2"]),
    (b"- alice\n- bob\n", ["the top level is a list", "allowed: [alice, bob]"]),
    (b"allowed: [alice, \xe9ve]\n", ["not UTF-8", "0xe9"]),
    (b"allowed: [alice]\nrevokd: [mallory]\n", ["unknown key 'revokd'"]),
    (b"revoked: [mallory]\nallowed: [alice]\nrevoked: []\n", ["`revoked` appears twice", "lines 1 and 3"]),
]


@pytest.mark.parametrize("raw,needles", BAD_ALLOWLISTS, ids=[f"bad{i}" for i in range(len(BAD_ALLOWLISTS))])
def test_an_allowlist_that_is_not_lists_of_names_is_refused(tmp_path, raw, needles):
    path = tmp_path / "allow.yaml"
    path.write_bytes(raw)
    with pytest.raises(ConfigError) as info:
        Allowlist(path)
    for needle in (str(path), *needles):
        assert needle in str(info.value), (needle, str(info.value))
    # the CLI's path: the same refusal, and the file is left as it was
    for action in ("list", "add", "revoke", "release"):
        with pytest.raises(ConfigError, match="allowlist"):
            Allowlist.edit(path, action, "eve")
    assert path.read_bytes() == raw
    assert sorted(p.name for p in tmp_path.iterdir()) == ["allow.yaml"]  # no temporary file left behind


def test_numeric_names_are_refused_until_quoted_and_the_cli_quotes_them(tmp_path):
    path = tmp_path / "allow.yaml"
    path.write_text("allowed: [alice, 007]\n")
    with pytest.raises(ConfigError, match="quote it: '007'"):
        Allowlist.edit(path, "add", "bob")  # was a raw TypeError ('<' between str and int)
    path.write_text("allowed: [alice, '007']\n")
    allow = Allowlist(path)
    assert allow.permits("007") and not allow.permits("7") and allow.allowed == {"alice", "007"}
    assert Allowlist.edit(path, "add", "010")["allowed"] == ["007", "010", "alice"]
    assert Allowlist(path).allowed == {"alice", "007", "010"}  # written quoted: read back as the same names


@pytest.mark.parametrize("raw", [b"allowed: [alice\nrevoked: [mallory]\n", b"- alice\n", b"revoked: mallory\n"],
                         ids=["yaml-error", "top-level-list", "scalar"])
def test_a_malformed_allowlist_at_start_stops_the_broker(prompt_file, tmp_path, raw):
    path = tmp_path / "allow.yaml"
    path.write_bytes(raw)
    with pytest.raises(ConfigError, match=f"allowlist {path}"):
        start_broker(broker_config(prompt_file, allowlist=str(path)))


def _replace(path, raw):
    """What an editor that saves atomically does: a new file renamed over the old one."""
    tmp = path.with_name(path.name + ".swp")
    tmp.write_bytes(raw)
    tmp.replace(path)


def _metrics(broker):
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{broker.http_port}/metrics", timeout=10) as r:
        return r.read().decode()


def test_a_bad_allowlist_edit_while_serving_keeps_the_last_good_list(prompt_file, prompts, tmp_path, caplog):
    path = tmp_path / "allow.yaml"
    path.write_text("allowed: [alice, bob]\n")
    broker = start_broker(broker_config(prompt_file, allowlist=str(path)))
    clients = []

    def join(name):
        c = BrokerClient(broker.address, name, rpc_timeout_s=5)
        clients.append(c)
        c.join(name, "tok", manifest(prompts), "share_all", 0)
        return c

    def served_as_before(i):
        """alice is answered normally, eve (never on a good list) is refused: not INTERNAL"""
        assert alice.publish(0, [summary(prompts[i], 1)]) == (1, 0)
        assert {n.node_id for n in alice.status().nodes} >= {"alice"}
        code, details = code_of(lambda: join("eve"))
        assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)

    try:
        alice = join("alice")
        # no heartbeat of alice's between a version's truncation and its write: the broker
        # would read an empty file then, and warn of that too
        stop_heartbeats(alice)
        bad_versions = [
            (lambda: path.write_bytes(b"allowed: [alice, bob, \xe9ve, eve]\n"), "not UTF-8"),  # in place
            (lambda: path.unlink(), "does not exist"),  # an editor moving it away before writing
            (lambda: _replace(path, b"allowed: [alice, bob, eve\n"), "not valid YAML"),
            (lambda: _replace(path, b"allowed: [alice, bob]\nrevoked: eve\n"), "single value 'eve'"),
            (lambda: path.write_bytes(b""), "empty (0 bytes)"),  # an in-place rewrite before its first write
        ]
        for i, (make, needle) in enumerate(bad_versions):
            caplog.clear()
            make()
            served_as_before(i)
            served_as_before(i + len(bad_versions))  # the same version again: no new warning
            warnings = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
            assert len(warnings) == 1 and needle in warnings[0] and "last good allowlist" in warnings[0], warnings
            assert "graft_fed_allowlist_valid 0" in _metrics(broker)  # what an alert watches
        # the next good version (saved atomically) takes effect at the next call
        _replace(path, b"allowed: [alice, bob, eve]\n")
        assert "graft_fed_allowlist_valid 1" in _metrics(broker)
        join("eve")
        Allowlist.edit(path, "revoke", "alice")
        code, details = code_of(lambda: alice.publish(1, [summary(prompts[0], 1, round=1)]))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "revoked" in details
    finally:
        for c in clients:
            c.close()
        broker.stop()


def test_a_bad_allowlist_version_is_parsed_and_reported_once(tmp_path, caplog, monkeypatch):
    import yaml

    path = tmp_path / "allow.yaml"
    path.write_text("allowed:\n" + "".join(f"  - univ-{i:04d}\n" for i in range(1000)))
    allow = Allowlist(path)
    parses = []
    real_init = yaml.SafeLoader.__init__

    def counting_init(self, *args, **kwargs):
        parses.append(1)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(yaml.SafeLoader, "__init__", counting_init)
    with path.open("a") as f:
        f.write("revoked: [oops\n")  # an edit with a typo
    for _ in range(50):
        assert allow.permits("univ-0001") and not allow.permits("eve")
    assert len(parses) == 1
    assert len([r for r in caplog.records if r.levelno >= 30 and str(path) in r.getMessage()]) == 1
    with path.open("a") as f:
        f.write("# another bad version\n")
    for _ in range(50):
        assert allow.permits("univ-0001")
    assert len(parses) == 2
    path.write_text("allowed: [eve]\n")
    for _ in range(50):
        assert allow.permits("eve") and not allow.permits("univ-0001")
    assert len(parses) == 3


def test_a_failed_allowlist_write_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    import os

    path = tmp_path / "allow.yaml"
    Allowlist.edit(path, "add", "alice")
    before = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(ConfigError, match="No space left on device"):
        Allowlist.edit(path, "revoke", "alice")
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["allow.yaml"]


def test_concurrent_allowlist_edits_lose_no_revocation(tmp_path):
    """`broker nodes revoke` run by two operators (or scripts) at once: each edit reads,
    changes and rewrites the file, so without the edit lock most revocations were written
    over (20 of 160 kept here)."""
    import threading

    path = tmp_path / "allow.yaml"

    def revoke(i):
        for j in range(10):
            Allowlist.edit(path, "revoke", f"n{i}-{j}")

    threads = [threading.Thread(target=revoke, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(Allowlist.edit(path, "list")["revoked"]) == 160
