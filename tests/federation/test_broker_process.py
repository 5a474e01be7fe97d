"""How a broker process starts and keeps its heap: `start_broker` (what `graft-fed broker`
and the benchmarks' broker processes call) and the housekeeping's malloc_trim."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from graft_fed.broker import server as server_mod
from graft_fed.errors import ConfigError

from .helpers import broker_config, start_broker


def _count_trims(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    calls: list[float] = []
    monkeypatch.setattr(server_mod, "trim_heap", lambda: calls.append(time.monotonic()) or True)
    return calls


def test_housekeeping_trims_the_heap_every_malloc_trim_s(prompt_file, monkeypatch):
    calls = _count_trims(monkeypatch)
    server = start_broker(broker_config(prompt_file, malloc_trim_s=1.0))
    try:
        deadline = time.monotonic() + 30
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        server.stop(0)
    assert len(calls) >= 2, "the housekeeping never trimmed the heap"
    assert calls[1] - calls[0] >= 0.9  # at its interval, not every housekeeping tick


def test_malloc_trim_s_zero_never_trims(prompt_file, monkeypatch):
    calls = _count_trims(monkeypatch)
    server = start_broker(broker_config(prompt_file, malloc_trim_s=0))
    try:
        time.sleep(2.5)  # two housekeeping ticks and more
    finally:
        server.stop(0)
    assert calls == []


def test_malloc_trim_s_is_checked(prompt_file):
    with pytest.raises(ConfigError, match="malloc_trim_s must be 0 \\(never\\) or >= 1"):
        broker_config(prompt_file, malloc_trim_s=0.2)


_START = """
import gc, json, sys
from pathlib import Path
from graft_fed.broker.config import BrokerConfig
from graft_fed.broker.server import start_broker
from graft_fed.configbase import from_mapping
cfg = from_mapping(BrokerConfig, {"listen": "127.0.0.1:0", "http": "", "db": ":memory:",
                                  "data": {"source": sys.argv[1]}, "verifier": {"name": "tests.plugins:odd_char_sum"},
                                  "n": 2, "prompts_per_round": 8, **json.loads(sys.argv[2])})
assert gc.get_freeze_count() == 0
ma_before = "numpy.ma" in sys.modules
before = sys.getswitchinterval()
server = start_broker(cfg)
frozen = gc.get_freeze_count()
server.stop(0)
print(json.dumps({"frozen": frozen, "port": server.port, "before": before, "interval": sys.getswitchinterval(),
                  "numpy_ma": [ma_before, "numpy.ma" in sys.modules]}))
"""


def _start(prompt_file, **settings) -> dict:
    out = subprocess.run([sys.executable, "-c", _START, str(prompt_file), json.dumps(settings)], capture_output=True,
                         text=True, timeout=120, cwd=str(Path(__file__).resolve().parents[2]))  # tests.plugins
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_start_broker_serves_then_freezes_what_is_loaded(prompt_file):
    """The benchmarks' broker processes start as `graft-fed broker` does: serving, what was
    loaded by then frozen out of the collector's sight (they used to skip the freeze), and
    the interpreter's switch interval at `switch_interval_ms` (0.5 by default); numpy.ma,
    which numpy imports on the first np.unique, imported then rather than in a round."""
    got = _start(prompt_file)
    assert got["port"] > 0
    assert got["numpy_ma"] == [False, True]
    assert got["frozen"] > 10_000  # modules, grpc, numpy, the state's caches
    assert got["before"] == 0.005 and got["interval"] == 0.0005


def test_switch_interval_ms_zero_keeps_pythons(prompt_file):
    assert _start(prompt_file, switch_interval_ms=0)["interval"] == 0.005
    assert _start(prompt_file, switch_interval_ms=2)["interval"] == 0.002
    with pytest.raises(ConfigError, match="switch_interval_ms must be 0"):
        broker_config(prompt_file, switch_interval_ms=-1)
