"""A node's pre-flight (graft_fed/federation/certcheck.py): its certificate checked locally
in one line, connection failures against a real loopback broker explained, and a node that
never joins told apart from one that did."""

from __future__ import annotations

import datetime as dt
import re

import pytest

from graft_fed.broker.config import load_broker_config
from graft_fed.broker.server import BrokerServer
from graft_fed.errors import ConfigError
from graft_fed.federation import certs
from graft_fed.federation.certcheck import (JoinTracker, NeverJoinedError, check_broker_certificate,
                                            check_node_certificate, explain_connect_failure, wait_for_first_join)
from graft_fed.federation.errors import FederationError
from graft_fed.node.client import BrokerClient


def _cert(ca_dir, name, days_from=-1, days_to=1, key=None):
    """A certificate for `name` from the CA in ca_dir, valid from/to days relative to now."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    key = key or ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now + dt.timedelta(days=days_from)).not_valid_after(now + dt.timedelta(days=days_to))
            .sign(ca_key, hashes.SHA256()))
    pem, keyfile = ca_dir / f"custom-{name}-{days_from}-{days_to}.pem", ca_dir / f"custom-{name}-{days_from}-{days_to}.key"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return str(pem), str(keyfile)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    a, b, a2 = root / "a", root / "b", root / "a-again"
    certs.init_ca(a, "fed")
    certs.init_ca(b, "other")
    certs.init_ca(a2, "fed")  # same name as a, another key
    certs.issue(a, "broker", ["127.0.0.1"])
    for d in (a, b, a2):
        certs.issue(d, "n1")
    return a, b, a2


def test_a_good_certificate_passes_and_no_tls_needs_no_check(pki):
    a, _, _ = pki
    check_node_certificate("n1", str(a / "ca.pem"), str(a / "n1.pem"), str(a / "n1.key"))
    check_node_certificate("n1", None, None, None)


@pytest.mark.parametrize("case, fragment", [
    ("expired", "expired 3 days ago"),
    ("not_yet", "is not valid before"),
    ("other_ca", "was issued by 'CN=other CA', not by the federation CA"),
    ("same_name_other_key", "carries the federation CA's name but not its signature"),
    ("wrong_name", "is issued to 'n1', but federation.node_id is 'n2'"),
    ("wrong_key", "is not the key of"),
    ("missing", "cannot read it"),
])
def test_each_certificate_problem_is_one_line(pki, case, fragment):
    a, b, a2 = pki
    ca, node_id = str(a / "ca.pem"), "n1"
    cert, key = str(a / "n1.pem"), str(a / "n1.key")
    if case == "expired":
        cert, key = _cert(a, "n1", days_from=-10, days_to=-3)
    elif case == "not_yet":
        cert, key = _cert(a, "n1", days_from=2, days_to=30)
    elif case == "other_ca":
        cert, key = str(b / "n1.pem"), str(b / "n1.key")
    elif case == "same_name_other_key":
        cert, key = str(a2 / "n1.pem"), str(a2 / "n1.key")
    elif case == "wrong_name":
        node_id = "n2"
    elif case == "wrong_key":
        key = str(b / "n1.key")
    elif case == "missing":
        cert = str(a / "nope.pem")
    with pytest.raises(ConfigError, match=fragment) as err:
        check_node_certificate(node_id, ca, cert, key)
    assert "\n" not in str(err.value)


def test_swapped_certificate_and_key_are_named_as_swapped(pki):
    a, _, _ = pki
    with pytest.raises(ConfigError, match=r"n1.key is a private key, not a certificate: are the certificate and key "
                                          r"swapped\?"):
        check_node_certificate("n1", str(a / "ca.pem"), str(a / "n1.key"), str(a / "n1.pem"))


@pytest.mark.parametrize("case, fragment", [
    ("swapped", r"broker.tls_cert .*broker.key is a private key, not a certificate: are the certificate and key "
                r"swapped\?"),
    ("key_swapped_in", r"broker.tls_key .*broker.pem is a certificate, not a private key"),
    ("wrong_key", r"broker.tls_key .*n1.key is not the key of broker.tls_cert .*broker.pem"),
    ("expired", r"broker.tls_cert .* expired 3 days ago"),
    ("missing_ca", r"broker.client_ca .*nope.pem: cannot read it"),
])
def test_a_broker_whose_tls_files_cannot_serve_says_which_and_is_not_blamed_on_the_port(pki, tmp_path, capsys, case,
                                                                                          fragment):
    """gRPC only failed to bind the port, which the broker command read as a port in use
    ("is another broker running?")."""
    from graft_fed.cli import main

    a, _, _ = pki
    cert, key, ca = str(a / "broker.pem"), str(a / "broker.key"), str(a / "ca.pem")
    if case == "swapped":
        cert, key = key, cert
    elif case == "key_swapped_in":
        key = cert
    elif case == "wrong_key":
        key = str(a / "n1.key")
    elif case == "expired":
        cert, key = _cert(a, "broker", days_from=-10, days_to=-3)
    elif case == "missing_ca":
        ca = str(a / "nope.pem")
    with pytest.raises(ConfigError, match=fragment):
        check_broker_certificate(cert, key, ca)
    check_broker_certificate(str(a / "broker.pem"), str(a / "broker.key"), str(a / "ca.pem"))
    db = tmp_path / "b.sqlite"
    assert main(["broker", "--set", "listen=127.0.0.1:0", "--set", "http=127.0.0.1:0", "--set", f"db={db}", "--set",
                 f"tls_cert={cert}", "--set", f"tls_key={key}", "--set", f"client_ca={ca}"]) == 2
    assert not db.exists()  # refused before the state was opened
    err = capsys.readouterr().err
    assert re.search(fragment, err) and "another broker" not in err and "cannot listen" not in err, err


@pytest.fixture(scope="module")
def brokers(pki, tmp_path_factory):
    a, _, _ = pki
    root = tmp_path_factory.mktemp("brokers")
    tls = BrokerServer(load_broker_config(None, {
        "listen": "127.0.0.1:0", "http": "", "db": str(root / "t.sqlite"), "tls_cert": str(a / "broker.pem"),
        "tls_key": str(a / "broker.key"), "client_ca": str(a / "ca.pem")})).start()
    plain = BrokerServer(load_broker_config(None, {"listen": "127.0.0.1:0", "http": "",
                                                   "db": str(root / "p.sqlite")})).start()
    yield tls, plain
    tls.stop()
    plain.stop()


@pytest.mark.parametrize("case, fragment", [
    ("dead", "nothing listens at"),
    ("plaintext_to_tls", "closed a plaintext connection: it most likely requires TLS"),
    ("no_client_cert", "requires a client certificate"),
    ("expired_cert", "refused this node's certificate"),
    ("other_federation_ca", "not signed by federation.tls_ca"),
    ("tls_to_plaintext", "answered in plaintext to TLS"),
])
def test_connection_failures_come_with_the_likely_cause(pki, brokers, case, fragment):
    a, b, _ = pki
    tls, plain = brokers
    mutual = dict(tls_ca=str(a / "ca.pem"), tls_cert=str(a / "n1.pem"), tls_key=str(a / "n1.key"))
    address, kw = {
        "dead": ("127.0.0.1:1", {}),
        "plaintext_to_tls": (tls.address, {}),
        "no_client_cert": (tls.address, dict(tls_ca=str(a / "ca.pem"))),
        "expired_cert": (tls.address, dict(tls_ca=str(a / "ca.pem"),
                                           **dict(zip(("tls_cert", "tls_key"), _cert(a, "n1", -10, -3))))),
        "other_federation_ca": (tls.address, dict(tls_ca=str(b / "ca.pem"), tls_cert=str(b / "n1.pem"),
                                                  tls_key=str(b / "n1.key"))),
        "tls_to_plaintext": (plain.address, mutual),
    }[case]
    client = BrokerClient(address, "n1", rpc_timeout_s=5, **kw)
    try:
        with pytest.raises(FederationError) as err:
            client.status()
    finally:
        client.close()
    explained = explain_connect_failure(address, f"{err.value.status} {err.value}", bool(kw.get("tls_ca")),
                                        bool(kw.get("tls_cert")))
    assert fragment in explained, (str(err.value), explained)


def test_a_node_that_never_joins_gets_the_cause_and_one_that_joins_late_does_not():
    tracker = JoinTracker("127.0.0.1:1", "n1", tls=False, client_cert=False)
    t = [0.0]

    def never() -> bool:
        tracker.failed(FederationError("Join: failed to connect to all addresses; Connection refused"))
        return False

    with pytest.raises(NeverJoinedError, match=r"never joined the broker at 127.0.0.1:1 \(3 attempt\(s\) in 2 s\): "
                                               "nothing listens"):
        wait_for_first_join(never, tracker, timeout_s=2, clock=lambda: t[0],
                            sleep=lambda s: t.__setitem__(0, t[0] + s))
    late = JoinTracker("b:1", "n1", tls=False, client_cert=False)
    answers = iter([False, False, True])
    wait_for_first_join(lambda: next(answers), late, timeout_s=60, sleep=lambda s: None)
    assert late.ever_joined


def _node_yaml(tmp_path, model, prompt_file, broker, **fed):
    import yaml

    cfg = {"run": {"name": "n1", "output_dir": str(tmp_path / "n1"), "steps": 1, "device": "cpu", "threads": 1,
                   "checkpoint_every": 0},
           "model": {"path": str(model)}, "data": {"source": str(prompt_file)},
           "rollout": {"n": 2, "max_new_tokens": 4}, "verifier": {"name": "tests.plugins:odd_char_sum"},
           "algorithm": {"prompts_per_step": 4, "num_minibatches": 2},
           "federation": {"broker": broker, "reconnect_min_s": 0.1, "reconnect_max_s": 0.3, "rpc_timeout_s": 1.0,
                          **fed}}
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_node_command_refuses_an_expired_certificate_before_loading_anything(pki, tmp_path, capsys):
    from graft_fed.cli import main

    a, _, _ = pki
    cert, key = _cert(a, "n1", -10, -3)
    path = _node_yaml(tmp_path, tmp_path / "not-even-loaded", tmp_path / "p.jsonl", "127.0.0.1:1",
                      tls_ca=str(a / "ca.pem"), tls_cert=cert, tls_key=key)
    assert main(["node", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "expired 3 days ago" in err and "Traceback" not in err


def test_a_node_that_never_joins_exits_non_zero_with_the_cause(tiny_llama, prompt_file, tmp_path, capsys):
    from graft_fed.cli import main

    path = _node_yaml(tmp_path, tiny_llama, prompt_file, "127.0.0.1:1")
    assert main(["node", "--config", str(path), "--quiet", "--join-timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert "never joined the broker at 127.0.0.1:1" in err and "nothing listens at 127.0.0.1:1" in err
    assert not (tmp_path / "n1" / "summary.json").exists(), "it must not have trained alone"


def test_status_with_a_certificate_off_the_allowlist_says_how_to_admit_it(pki, tmp_path, capsys):
    """It said "see the broker's log for the cause" beside the broker's own answer (deploy.md
    told the operator to keep its status certificate off the allowlist, which refuses it)."""
    from graft_fed.broker.auth import Allowlist
    from graft_fed.cli import main

    a, _, _ = pki
    allow = tmp_path / "allow.yaml"
    Allowlist.edit(allow, "add", "someone-else")
    broker = BrokerServer(load_broker_config(None, {
        "listen": "127.0.0.1:0", "http": "", "db": str(tmp_path / "t.sqlite"), "tls_cert": str(a / "broker.pem"),
        "tls_key": str(a / "broker.key"), "client_ca": str(a / "ca.pem"), "allowlist": str(allow)})).start()
    try:
        tls = ["--tls-ca", str(a / "ca.pem"), "--tls-cert", str(a / "n1.pem"), "--tls-key", str(a / "n1.key")]
        assert main(["status", "--broker", broker.address, *tls]) == 2
        err = capsys.readouterr().err
        assert "allowlist does not admit this certificate's name" in err and "broker nodes add" in err, err
        assert "see the broker's log" not in err
        Allowlist.edit(allow, "add", "n1")
        assert main(["status", "--broker", broker.address, *tls]) == 0
    finally:
        broker.stop()


def test_a_tls_broker_across_a_slow_link_is_reached_at_the_first_call(pki, brokers):
    """gRPC's shortest connection attempt was set to 200 ms (`grpc.min_reconnect_backoff_ms`
    is also its minimum connect timeout), shorter than a TLS handshake over a link of 100 ms
    each way (another continent): status failed at once, "it most likely refused this node's
    certificate", and a node joined only once gRPC's backoff had grown."""
    from tests.federation.faultproxy import FaultProxy

    a, _, _ = pki
    tls, _ = brokers
    proxy = FaultProxy(tls.address).start()
    try:
        proxy.set("delay", delay_s=0.1)
        client = BrokerClient(proxy.address, "n1", rpc_timeout_s=20, tls_ca=str(a / "ca.pem"),
                              tls_cert=str(a / "n1.pem"), tls_key=str(a / "n1.key"))
        try:
            assert client.status().manifest.n >= 2
        finally:
            client.close()
    finally:
        proxy.close()
