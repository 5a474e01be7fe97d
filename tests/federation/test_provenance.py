"""Signed bundles: the producing node signs, the receiver checks, and a relaying broker that
alters or forges a bundle is caught. Over a real mutual-TLS broker on loopback; the
"malicious broker" edits its own state between upload and fetch, as a compromised broker
would."""

import dataclasses
import datetime as dt

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from graft_fed.errors import ConfigError
from graft_fed.federation import certs
from graft_fed.federation.bundles import digest_of, encode_bundle
from graft_fed.federation.signing import BundleSigner, ProvenanceError, ProvenanceVerifier, signed_message
from graft_fed.node.client import BrokerClient
from graft_fed.node.peers import fetch_offers
from tests.federation.helpers import broker_config, node_config, run_nodes, start_broker
from tests.federation.test_broker_rpc import code_of, manifest, record, summary


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = certs.loopback_pki(tmp_path_factory.mktemp("certs"), "test", ("alice", "bob", "mallory", "llama", "gpt2"))
    evil = tmp_path_factory.mktemp("evil")  # another CA, with a certificate that also says "alice"
    certs.init_ca(evil, "evil")
    certs.issue(evil, "alice")
    return d, evil


@pytest.fixture()
def prompts(prompt_file):
    from graft_fed.data.config import DataConfig, load_prompts

    return load_prompts(DataConfig(source=str(prompt_file)))


def der(path):
    return x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(serialization.Encoding.DER)


def signer(directory, name):
    return BundleSigner(directory / f"{name}.pem", directory / f"{name}.key")


def mtls_client(pki, address, name, **kw):
    d = pki[0]
    return BrokerClient(address, name, tls_ca=str(d / "ca.pem"), tls_cert=str(d / f"{name}.pem"),
                        tls_key=str(d / f"{name}.key"), rpc_timeout_s=5, **kw)


@pytest.fixture(params=[False, True], ids=["grpc-in-broker", "front-process"])
def mtls_broker(pki, prompt_file, request):
    """Also with the front process, which must hand the broker the client certificate it saw."""
    d = pki[0]
    broker = start_broker(broker_config(prompt_file, tls_cert=str(d / "broker.pem"), tls_key=str(d / "broker.key"),
                                        client_ca=str(d / "ca.pem"), balance="none", front_process=request.param))
    yield broker
    broker.stop()


def matched(broker, pki, prompts, **receiver_kw):
    """alice solved p0 once and uploaded its bundle (signed); bob failed p0 and is matched to it."""
    alice, bob = mtls_client(pki, broker.address, "alice"), mtls_client(pki, broker.address, "bob", **receiver_kw)
    for c in (alice, bob):
        c.join(c.node_id, "tok", manifest(prompts), "share_all", 0)
    p0 = prompts[0]
    alice.publish(0, [summary(p0, 1)])
    bob.publish(0, [summary(p0, 0)])
    rec = record(p0, 1, model="alice")
    digest, stored = alice.upload(rec, 0)
    assert stored
    return alice, bob, rec, digest


def test_sign_and_verify_unit(pki):
    d, evil = pki
    v = ProvenanceVerifier(d / "ca.pem")
    digest = "ab" * 32
    sig = signer(d, "alice").sign("alice", digest)
    assert v.verify("alice", digest, sig, der(d / "alice.pem")) == "alice"
    assert v.verify("alice", digest, sig, der(d / "alice.pem")) == "alice"  # the cached chain check
    cases = [
        (("alice", "cd" * 32, sig, der(d / "alice.pem")), "does not verify"),  # other bytes
        (("bob", digest, sig, der(d / "alice.pem")), "signed by 'alice'"),  # offered as another node's
        (("alice", digest, signer(evil, "alice").sign("alice", digest), der(evil / "alice.pem")),
         "not issued by this node's federation CA"),
        (("alice", digest, signer(d, "mallory").sign("alice", digest), der(d / "alice.pem")), "does not verify"),
        (("alice", digest, b"", b""), "unsigned"),
        (("alice", digest, sig, b"\x30\x03junk"), "not a DER X.509 certificate"),
    ]
    for args, message in cases:
        with pytest.raises(ProvenanceError, match=message):
            v.verify(*args)
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=3000)
    with pytest.raises(ProvenanceError, match="not valid now"):
        v.verify("alice", digest, sig, der(d / "alice.pem"), now=later)
    # the signed message binds the producer and the digest, with a context of its own
    assert signed_message("alice", digest) == b"graft-fed/bundle/v1\nalice\n" + digest.encode()
    with pytest.raises(ConfigError, match="does not belong"):
        BundleSigner(d / "alice.pem", d / "bob.key")
    with pytest.raises(ConfigError, match="federation CA"):
        BrokerClient("127.0.0.1:1", "x", require_signatures=True)


def test_signed_round_trip_over_mutual_tls(mtls_broker, pki, prompts):
    alice, bob, rec, digest = matched(mtls_broker, pki, prompts)
    # the broker kept the signature and the certificate it saw in alice's mTLS handshake
    sig, cert = mtls_broker.state.bundle_provenance(digest)
    assert sig and cert == der(pki[0] / "alice.pem")
    offers = bob.get_matches(0, 5.0).offers
    assert [(o.source_node, o.digest) for o in offers] == [("alice", digest)]
    got = fetch_offers(bob, offers)
    assert got.records == {rec.prompt_id: rec} and got.bad == 0 and got.rejections == []
    assert got.metrics() == {"federation/bad_signatures": 0.0, "federation/unsigned_bundles": 0.0,
                             "federation/fetch_refused": 0.0, "federation/undelivered": 0.0,
                             "federation/delivery_failed": 0.0}
    assert bob.fetch_bundle(digest, "alice").signer == "alice"
    assert bob.require_signatures and alice.signer is not None  # the default under mutual TLS
    for c in (alice, bob):
        c.close()


def tamper(broker, digest, rec, provenance=None, run_id=""):
    """What a malicious broker can do: alter the group, store it under its new digest with the
    signature and certificate it likes (default: keep alice's), and point alice's summary at
    it. Returns the new digest."""
    forged = dataclasses.replace(rec, texts=("the answer is 2", rec.texts[1]), run_id=run_id)
    data = encode_bundle(forged)
    new = digest_of(data)
    sig, cert = provenance(new) if provenance else broker.state.bundle_provenance(digest)
    broker.state.put_bundle(new, data, signature=sig, signer_cert=cert)
    broker.state.set_bundle_digest("alice", 0, rec.prompt_id, new)
    broker.fed.index.set_digest(0, "alice", rec.prompt_id, new)  # the broker answers from its round index
    return new


@pytest.mark.parametrize("attack", ["alter_bytes", "own_key_and_cert", "other_ca_same_name", "strip_signature"])
def test_a_broker_that_alters_or_forges_a_bundle_is_caught(mtls_broker, pki, prompts, attack):
    d, evil = pki
    alice, bob, rec, digest = matched(mtls_broker, pki, prompts)
    forge = {
        "alter_bytes": (None, "does not verify"),  # re-digested, alice's signature of the original kept
        # signed afresh with a valid key of the federation CA, but not alice's
        "own_key_and_cert": (lambda new: (signer(d, "mallory").sign("alice", new), der(d / "mallory.pem")),
                             "signed by 'mallory'"),
        # a certificate that says "alice", from a CA the broker made up
        "other_ca_same_name": (lambda new: (signer(evil, "alice").sign("alice", new), der(evil / "alice.pem")),
                               "not issued by this node's federation CA"),
        "strip_signature": (lambda new: (b"", b""), "unsigned"),
    }
    provenance, message = forge[attack]
    new = tamper(mtls_broker, digest, rec, provenance)
    offers = bob.get_matches(0, 5.0).offers
    assert [o.digest for o in offers] == [new]
    with pytest.raises(ProvenanceError, match=message):
        bob.fetch_bundle(new, "alice")
    got = fetch_offers(bob, offers)
    assert got.records == {} and got.bad == 1 and got.bad_signatures == 1
    # reported as a rejected group of the named source: the broker's quarantine counts it
    assert [(e.source, e.prompt_id, e.rejected) for e in got.rejections] == [("alice", rec.prompt_id, True)]
    bob.report(0, got.rejections)
    pair = [c for c in mtls_broker.state.compat() if (c.source, c.receiver) == ("alice", "bob")]
    assert pair[0].rejected == 1
    for c in (alice, bob):
        c.close()


def test_unsigned_bundles_are_refused_when_required_and_counted_when_not(mtls_broker, pki, prompts):
    alice, bob, rec, digest = matched(mtls_broker, pki, prompts, require_signatures=False)
    new = tamper(mtls_broker, digest, rec, lambda new: (b"", b""), run_id="unsigned")
    offers = bob.get_matches(0, 5.0).offers
    got = fetch_offers(bob, offers)  # bob accepts an unsigned bundle and counts it...
    assert list(got.records) == [rec.prompt_id] and got.unsigned == 1 and got.bad == 0
    assert got.metrics()["federation/unsigned_bundles"] == 1.0
    strict = mtls_client(pki, mtls_broker.address, "bob")  # ...a node that requires signatures refuses it
    strict.session = bob.session
    assert fetch_offers(strict, offers).bad_signatures == 1
    # a signature that is present is checked even where signatures are not required
    altered = tamper(mtls_broker, digest, rec, run_id="altered")
    assert [o.digest for o in bob.get_matches(0, 5.0).offers] == [altered]
    with pytest.raises(ProvenanceError, match="does not verify"):
        bob.fetch_bundle(altered, "alice")
    assert new != altered
    for c in (alice, bob, strict):
        c.close()


def test_the_broker_refuses_a_signature_that_does_not_match_the_connection(mtls_broker, pki, prompts):
    alice = mtls_client(pki, mtls_broker.address, "alice")
    alice.join("alice", "tok", manifest(prompts), "share_all", 0)
    alice.publish(0, [summary(prompts[0], 1)])
    alice.signer = signer(pki[0], "mallory")  # signs with a key that is not its connection's
    code, details = code_of(lambda: alice.upload(record(prompts[0], 1, model="alice"), 0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "signature rejected" in details
    assert mtls_broker.state.bundle_stats() == (0, 0)
    alice.close()


def test_without_mutual_tls_bundles_travel_unsigned(prompt_file, prompts, pki, caplog):
    broker = start_broker(broker_config(prompt_file, balance="none"))  # plaintext loopback
    try:
        a, b = BrokerClient(broker.address, "a"), BrokerClient(broker.address, "b")
        for c in (a, b):
            c.join(c.node_id, "tok", manifest(prompts), "share_all", 0)
        assert not b.require_signatures and a.signer is None  # nothing to sign with
        a.publish(0, [summary(prompts[0], 1)])
        b.publish(0, [summary(prompts[0], 0)])
        digest, _ = a.upload(record(prompts[0], 1, model="a"), 0)
        assert broker.state.bundle_provenance(digest) == (b"", b"")
        got = fetch_offers(b, b.get_matches(0, 5.0).offers)
        assert got.unsigned == 1 and len(got.records) == 1
        assert "cannot verify who produced it" in caplog.text
        fetch_offers(b, b.get_matches(0, 5.0).offers)
        assert caplog.text.count("cannot verify who produced it") == 1  # logged once
        for c in (a, b):
            c.close()
    finally:
        broker.stop()


def test_two_nodes_over_mutual_tls_sign_and_verify_every_bundle(tiny_llama, tiny_gpt2, prompt_file, pki, tmp_path):
    import json

    d = pki[0]
    broker = start_broker(broker_config(prompt_file, min_nodes=2, tls_cert=str(d / "broker.pem"),
                                        tls_key=str(d / "broker.key"), client_ca=str(d / "ca.pem")))
    try:
        tls = lambda name: {"tls_ca": str(d / "ca.pem"), "tls_cert": str(d / f"{name}.pem"),  # noqa: E731
                            "tls_key": str(d / f"{name}.key")}
        run_nodes([node_config("llama", tiny_llama, prompt_file, tmp_path, broker.address, steps=3, **tls("llama")),
                   node_config("gpt2", tiny_gpt2, prompt_file, tmp_path, broker.address, steps=3, **tls("gpt2"))])
        digests = {s.bundle_digest for s in broker.state.summaries() if s.bundle_digest}
        producers = {s.bundle_digest: s.node_id for s in broker.state.summaries() if s.bundle_digest}
        assert digests and broker.fed.counters["bundles_unsigned"] == 0
        for digest in digests:  # stored with the signature and the producer's own certificate
            sig, cert = broker.state.bundle_provenance(digest)
            assert sig and cert == der(d / f"{producers[digest]}.pem")
    finally:
        broker.stop()
    received = 0
    for name in ("llama", "gpt2"):
        for row in (json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()):
            assert row["federation/connected"] == 1.0
            assert row["federation/bad_signatures"] == 0.0 and row["federation/unsigned_bundles"] == 0.0
            received += row.get("graft/replaced", 0)
    assert received > 0, "no bundle was exchanged: the test would show nothing"


def serial_of(path):
    return str(x509.load_pem_x509_certificate(path.read_bytes()).serial_number)


def test_a_revoked_signer_is_refused_even_for_bundles_signed_before(pki, tmp_path, caplog):
    import json
    import os

    d = pki[0]
    listing = tmp_path / "revoked.json"
    listing.write_text("[]")
    v = ProvenanceVerifier(d / "ca.pem", listing)
    digest = "ef" * 32
    alice_sig, bob_sig = signer(d, "alice").sign("alice", digest), signer(d, "bob").sign("bob", digest)
    assert v.verify("alice", digest, alice_sig, der(d / "alice.pem")) == "alice"
    # the CA revokes alice; the list reaches this node; the signature made before is now refused
    listing.write_text(json.dumps([{"name": "alice", "serial": serial_of(d / "alice.pem"),
                                    "revoked_at": "2026-11-30T10:00:00+00:00"}]))
    os.utime(listing, ns=(1, 10**18))  # a new stamp even on a coarse-clock file system
    with pytest.raises(ProvenanceError, match=r"'alice', serial \d+\) was revoked \(listed as 'alice'"):
        v.verify("alice", digest, alice_sig, der(d / "alice.pem"))
    assert v.verify("bob", digest, bob_sig, der(d / "bob.pem")) == "bob"
    # a bad edit of the list never lifts a revocation: the last good list stays in force
    listing.write_text("[{not json")
    with pytest.raises(ProvenanceError, match="was revoked"):
        v.verify("alice", digest, alice_sig, der(d / "alice.pem"))
    assert "keeping the 1 revocations read before" in caplog.text
    listing.unlink()
    with pytest.raises(ProvenanceError, match="was revoked"):
        v.verify("alice", digest, alice_sig, der(d / "alice.pem"))
    # at start a bad list is a configuration error naming the file
    bad = tmp_path / "bad.json"
    for text, message in (("{}", "must be a JSON list"), ('[{"name": "x"}]', "entry 0"), ("nope", "not JSON")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=message):
            ProvenanceVerifier(d / "ca.pem", bad)
    with pytest.raises(ConfigError, match="cannot read the revocation list"):
        ProvenanceVerifier(d / "ca.pem", tmp_path / "missing.json")
    # certs revoke writes exactly the file a node reads
    ca = tmp_path / "ca"
    certs.init_ca(ca, "t")
    certs.issue(ca, "carol")
    certs.revoke(ca, "carol")
    assert ProvenanceVerifier(ca / "ca.pem", ca / "revoked.json").revoked_serials() == {
        int(serial_of(ca / "carol.pem")): "carol"}


def test_a_node_with_the_revocation_list_refuses_and_reports_the_bundle(mtls_broker, pki, prompts, tmp_path):
    import json

    from graft_fed.node.node import FederationSection

    listing = tmp_path / "revoked.json"
    listing.write_text(json.dumps([{"name": "alice", "serial": serial_of(pki[0] / "alice.pem")}]))
    alice, bob, rec, digest = matched(mtls_broker, pki, prompts, revoked_certs=str(listing))
    got = fetch_offers(bob, bob.get_matches(0, 5.0).offers)
    assert got.records == {} and got.bad_signatures == 1
    assert [r.source for r in got.rejections] == ["alice"]
    for c in (alice, bob):
        c.close()
    with pytest.raises(ConfigError, match="revoked_certs needs federation.tls_ca"):
        FederationSection(revoked_certs=str(listing))
    with pytest.raises(ConfigError, match="needs federation.tls_ca"):
        BrokerClient("127.0.0.1:1", "x", revoked_certs=str(listing))


def test_a_relayed_certificate_with_a_malformed_name_is_a_provenance_error(pki):
    """A hostile broker relays a certificate whose subject does not parse (an invalid UTF-8
    common name): the cryptography library parses names lazily, and the ValueError it raised
    at first use escaped the receiver's checks and ended the node's step."""
    d, _ = pki
    v = ProvenanceVerifier(d / "ca.pem")
    digest = "ab" * 32
    bad = der(d / "mallory.pem").replace(b"mallory", b"\xff\xfe\xfd\xfcory")
    for producer in ("mallory", "alice"):
        with pytest.raises(ProvenanceError, match="not a DER X.509 certificate"):
            v.verify(producer, digest, b"sig", bad)
