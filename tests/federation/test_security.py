"""Transport security and identity: mutual TLS on loopback with a throwaway CA."""

import grpc
import pytest

from graft_fed.broker.auth import Allowlist
from graft_fed.errors import ConfigError
from graft_fed.federation import certs
from graft_fed.federation.transport import check_plaintext, is_loopback
from graft_fed.node.client import BrokerClient
from graft_fed.proto import broker_pb2 as pb
from tests.federation.helpers import broker_config, start_broker, tls_client
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
        alice.join("alice", "tok", manifest(prompts), "share_all", 0)
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
