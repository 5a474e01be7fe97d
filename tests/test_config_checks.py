"""Settings that used to be taken and then misbehave (a port that wraps, a NaN, a value that
fails every second at run time, a key given twice) are refused when the config loads, with
a message that names the key and says what to write."""

from __future__ import annotations

import pytest

from graft_fed.broker.config import load_broker_config
from graft_fed.configbase import load_yaml, parse_overrides, require_address
from graft_fed.errors import ConfigError
from graft_fed.node.node import load_node_config


@pytest.mark.parametrize("value, message", [
    ("127.0.0.1:99999", "port must be a number in 0-65535"),
    ("127.0.0.1:65536", "port must be a number in 0-65535"),
    ("127.0.0.1:-5", "port must be a number in 0-65535"),
    ("127.0.0.1:abc", "port must be a number"),
    ("127.0.0.1", "must be HOST:PORT"),
    (":50551", "must be HOST:PORT"),
    ("::1:50551", "IPv6 host in brackets"),
])
def test_addresses_are_checked_where_the_config_loads(value, message):
    with pytest.raises(ConfigError, match=f"broker.listen.*{message}"):
        load_broker_config(None, {"listen": value})
    with pytest.raises(ConfigError, match=f"broker.http.*{message}"):
        load_broker_config(None, {"http": value})
    assert load_broker_config(None, {"listen": "[::1]:0", "http": ""}).listen == "[::1]:0"


def test_a_node_needs_a_real_port_to_call():
    for bad in ("127.0.0.1:0", "host:99999"):
        with pytest.raises(ConfigError, match="federation.broker: the port must be a number in 1-65535"):
            load_node_config(None, {"federation.broker": bad})
    require_address("broker.example.org:443", "federation.broker", port_zero=False)


@pytest.mark.parametrize("key, value, message", [
    ("max_bundle_gib", -1, "max_bundle_gib must be a finite number of GiB >= 0"),
    ("max_bundle_gib", float("inf"), "max_bundle_gib must be a finite"),
    ("max_bundle_gib", float("nan"), "NaN is not a setting"),
    ("keep_rounds", 10**30, "keep_rounds must be >= 1"),
    ("seed", -1, r"seed must be in \[0, 2\^64\)"),
    ("seed", 2**64, r"seed must be in \[0, 2\^64\)"),
    ("n", 2**32, "broker.n must be in"),
    ("prompts_per_round", 2**32, "prompts_per_round must be >= 1 and < 2"),
    ("staleness_rounds", 2**32, "staleness_rounds must be >= 0 and < 2"),
    ("heartbeat_interval_s", 1e-300, "heartbeat_interval_s must be >= 0.1"),
    ("round_deadline_s", float("nan"), "NaN is not a setting"),
    ("replay_window_s", float("inf"), "replay_window_s must be >= 1 and finite"),
    ("max_requests_per_s", float("inf"), "max_requests_per_s must be >= 0 and finite"),
    ("max_workers", 10**6, r"max_workers must be in \[8, 4096\]"),
    # a quota below one publish's summaries refuses every node's first full round
    ("max_node_summaries", 100, r"max_node_summaries must be 0 \(off\) or at least .* = 128; got 100"),
    ("max_node_summaries", -1, "max_node_summaries must be 0"),
])
def test_broker_values_that_failed_at_run_time_are_refused_at_load(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_broker_config(None, {key: value})


def test_a_bound_on_how_far_back_retention_waits_needs_retention_and_a_round_count():
    with pytest.raises(ConfigError, match=r"retention_max_lag_rounds bounds .* retention is off \(keep_rounds is null\)"):
        load_broker_config(None, {"retention_max_lag_rounds": 10})
    with pytest.raises(ConfigError, match=r"retention_max_lag_rounds must be >= 0 .* got -1"):
        load_broker_config(None, {"keep_rounds": 4, "retention_max_lag_rounds": -1})
    assert load_broker_config(None, {"keep_rounds": 4, "retention_max_lag_rounds": 0}).retention_max_lag_rounds == 0


def test_async_retention_must_keep_the_rounds_receivers_are_offered():
    """In async mode a receiver is offered groups up to staleness_rounds old: retention of
    fewer rounds dropped them (and their bundles) before the receiver fetched them."""
    with pytest.raises(ConfigError, match=r"keep_rounds \(4\) must be above staleness_rounds \(4\)"):
        load_broker_config(None, {"mode": "async", "keep_rounds": 4})
    load_broker_config(None, {"mode": "async", "keep_rounds": 5})
    load_broker_config(None, {"mode": "sync", "keep_rounds": 1})


@pytest.mark.parametrize("key, value, message", [
    ("rpc_timeout_s", -1, "rpc_timeout_s must be seconds > 0"),
    ("rpc_timeout_s", 0, "rpc_timeout_s must be seconds > 0"),
    ("rpc_timeout_s", float("nan"), "NaN is not a setting"),
    ("match_wait_s", float("inf"), "match_wait_s must be seconds > 0 and at most a day"),
    ("max_message_mib", 0, r"max_message_mib must be in \[1, 1024\]"),
    ("max_message_mib", -5, r"max_message_mib must be in \[1, 1024\]"),
    ("chunk_kib", 16 * 1024, "chunk_kib must be >= 16 .* at most half of max_message_mib"),
    ("max_bundle_mib", 0, r"max_bundle_mib must be a whole number of MiB in \[1, 65536\], got 0"),
    ("max_bundle_mib", 10**6, r"max_bundle_mib must be a whole number of MiB in \[1, 65536\], got 1000000"),
])
def test_node_federation_values_that_failed_every_call_are_refused_at_load(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_node_config(None, {f"federation.{key}": value})


def test_a_key_given_twice_is_an_error_naming_both_lines(tmp_path):
    path = tmp_path / "broker.yaml"
    path.write_text("n: 4\nmode: sync\nn: 8\n")
    with pytest.raises(ConfigError, match=r"key 'n' is given twice \(lines 1 and 3\)"):
        load_broker_config(path)
    path.write_text("federation_id: f\ndata:\n  dataset_id: f\n  federation_id: g\n")  # one key, two mappings
    with pytest.raises(ConfigError, match="unknown key 'data.federation_id'"):  # not "given twice"
        load_broker_config(path)


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "broker.yaml"
    path.write_bytes(b"federation_id: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0xe9 at offset 18\); save it as UTF-8"):
        load_yaml(path)


def test_a_set_value_that_is_not_yaml_is_taken_as_written():
    assert parse_overrides(["listen=[::1]:0", "n=4", "client_ca=null"]) == {"listen": "[::1]:0", "n": 4,
                                                                             "client_ca": None}
    assert load_broker_config(None, parse_overrides(["listen=[::1]:0"])).listen == "[::1]:0"


def test_an_empty_set_value_is_the_empty_string_as_the_brokers_advice_gives_it():
    """web.py says "turn it off with --set http=''"; a shell passes that as `http=`, which
    was YAML's null and then refused ("null is not allowed here")."""
    import shlex

    from graft_fed.cli import build_parser

    argv = ["broker", *shlex.split("--set http='' --set listen=127.0.0.1:0")]
    args = build_parser().parse_args(argv)
    assert load_broker_config(None, parse_overrides(args.set)).http == ""
    with pytest.raises(ConfigError, match="seed"):  # still a clear error where a number is wanted
        load_broker_config(None, parse_overrides(["seed="]))


def test_merge_keys_still_share_sections_and_duplicates_on_one_line_are_caught(tmp_path):
    from graft_fed.configbase import safe_load

    assert safe_load("base: &b {lr: 1, wd: 0}\nother:\n  <<: *b\n  lr: 2\n") == {
        "base": {"lr": 1, "wd": 0}, "other": {"lr": 2, "wd": 0}}
    with pytest.raises(Exception, match=r"key 'n' is given twice \(line 1\)"):
        safe_load("a: {n: 4, n: 8}\n")


@pytest.mark.parametrize("text", ["nan", "NaN", ".nan"])
def test_nan_is_refused_however_yaml_reads_it(text):
    from graft_fed.trainer.config import load_train_config

    with pytest.raises(ConfigError, match="optim.eps: NaN is not a setting"):
        load_train_config(None, parse_overrides([f"optim.eps={text}"]))


def test_the_broker_says_at_start_when_honest_nodes_will_reach_their_summary_quota(caplog):
    """max_node_summaries bounds what a node holds; with retention off (the default) or
    keeping more rounds than the quota holds, honest nodes reach it too: the broker says
    after how many rounds, at start."""
    from graft_fed.broker.server import _say_quota_reach

    with caplog.at_level("INFO", logger="graft_fed.broker"):
        _say_quota_reach(load_broker_config(None, {}))  # 10,000,000 / 32
        _say_quota_reach(load_broker_config(None, {"keep_rounds": 100, "max_node_summaries": 3200}))  # 100 rounds
        _say_quota_reach(load_broker_config(None, {"keep_rounds": 100, "max_node_summaries": 640_000}))  # plenty
        _say_quota_reach(load_broker_config(None, {"max_node_summaries": 0}))  # off
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert len(said) == 2
    assert said[0][0] == "INFO" and "after about 312500 rounds" in said[0][1] and "set keep_rounds" in said[0][1]
    assert said[1][0] == "WARNING" and "holds 100 rounds of 32 summaries" in said[1][1]
