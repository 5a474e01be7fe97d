"""bench/broker/ingest_match.py's --timing: where a call's time went, from the node's send
and receipt and the broker's three times (TIMING_KEY), and when the ready GetMatches were
taken and answered after the round's last acknowledged publish."""

import importlib.util
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    sys.path.insert(0, str(ROOT / "bench" / "broker"))
    try:
        spec = importlib.util.spec_from_file_location("ingest_match_bench", ROOT / "bench" / "broker" / "ingest_match.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(ROOT / "bench" / "broker"))


def test_segments_and_times_after_the_last_ack():
    bench = _module()
    # one round, two nodes: (sent, picked, entered, left, received)
    publishes = [[(0.0, 0.1, 0.2, 0.5, 0.6), (0.0, 0.3, 0.4, 0.9, 1.0)]]  # the last ack at 1.0
    matches = [[(0.6, 1.2, 1.3, 1.4, 1.5), None]]  # the second node's times were not sent
    t = bench.call_segments(publishes, matches)
    assert t["publish"]["calls"] == 2 and t["matches"]["calls"] == 1
    assert math.isclose(t["publish"]["queued"]["max"], 0.3)
    assert math.isclose(t["publish"]["handler"]["max"], 0.5)
    assert math.isclose(t["matches"]["queued"]["p50"], 0.6)
    assert math.isclose(t["matches"]["back"]["p99"], 0.1)
    after = t["matches"]["after_last_ack"]
    assert math.isclose(after["picked"]["p50"], 0.2) and math.isclose(after["received"]["max"], 0.5)
    assert math.isclose(after["left"]["p50"], 0.4)
    cell = {"nodes": 2, "prompts": 8, "sqlite": {"timing": t}}
    table = "\n".join(bench.timing_table([cell], ["sqlite"]))
    assert "| 2 | 8 | sqlite | GetMatches (ready) | 600.0 / 600.0 |" in table
    assert "| 200 / 200 | 400 / 400 | 500 / 500 |" in table


def test_the_raw_baseline_pools_its_runs_before_and_after_the_broker():
    """The raw gRPC rate of a cell is its two runs' messages over their total time (not the
    mean of their rates), with each run's own rate kept."""
    bench = _module()
    before = {"messages": 4, "windows_s": [0.5, 0.5], "msgs_per_s": 4.0, "bytes_per_round": 10}
    after = {"messages": 4, "windows_s": [1.5, 1.5], "msgs_per_s": 4 / 3, "bytes_per_round": 10}
    raw = bench.pooled_raw(before, after)
    assert raw["messages"] == 8 and raw["windows_s"] == [0.5, 0.5, 1.5, 1.5]
    assert math.isclose(raw["msgs_per_s"], 2.0)  # 8 messages in 4 s; the mean of the rates would say 2.67
    assert raw["runs_msgs_per_s"] == [4.0, 4 / 3] and raw["bytes_per_round"] == 10
