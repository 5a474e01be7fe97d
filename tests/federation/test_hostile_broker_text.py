"""What a hostile broker writes reaches a node's log and an operator's terminal (`graft-fed
status`, a refused join): its control, format and C1 characters are escaped there, so it
cannot clear the screen, retitle the window, write the clipboard (OSC 52) or forge log lines."""

import grpc

from graft_fed.cli import _status_table
from graft_fed.federation.status import from_rpc_error

EVIL = "ok\x1b[2J\x1b]52;c;Y3VybCBldmlsfHNo\x07\x9b31m\u202e\r\nINFO forged line\u2028"


def _clean(text):
    return not any(c in text for c in "\x1b\x07\x9b\u202e\r\n\u2028")


def test_status_of_a_hostile_broker_is_shown_escaped():
    manifest = {"federation_id": EVIL, "protocol_version": 1, "dataset_id": EVIL, "dataset_hash": EVIL, "seed": 0,
                "n": 8, "prompts_per_round": 4, "mode": "sync", "verifier_name": EVIL, "verifier_version": EVIL,
                "staleness_rounds": 0, "advantage": EVIL}
    d = {"federation_id": EVIL, "dataset_id": EVIL, "n": 8, "prompts_per_round": 4, "manifest": manifest,
         "current_round": 3, "bundles": 0, "bundle_bytes": 0, "max_node_summaries": 0, "max_node_bundle_bytes": 0,
         "nodes": [{"node_id": EVIL, "model_id": EVIL, "state": EVIL, "round": 1, "published": 2,
                    "last_seen_s": 0.5, "summaries_held": 8, "bundle_bytes_held": 0}],
         "pairs": [{"source": EVIL, "receiver": EVIL, "groups": 1, "mean_s": 0.5, "admitted_fraction": 1.0,
                    "rejected": 0, "reported": 1, "undelivered": 0}], "pairs_total": 1}
    table = _status_table(d)
    assert all(_clean(line) for line in table.split("\n")) and len(table.split("\n")) == 8
    assert "ok\\x1b[2J" in table and "forged line" in table


def test_a_hostile_brokers_error_message_is_escaped():
    class Err(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.PERMISSION_DENIED

        def details(self):
            return EVIL

    err = from_rpc_error(Err(), "Join")
    assert _clean(str(err)) and str(err).startswith("Join: ok\\x1b[2J")
