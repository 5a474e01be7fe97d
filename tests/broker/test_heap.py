"""broker/heap.py: the C heap's arenas and its thresholds for chunk-sized buffers."""

import json
import os
import platform
import subprocess
import sys

import pytest

from graft_fed.broker.heap import keep_chunk_buffers


def test_thresholds_are_set_on_glibc_and_left_alone_elsewhere():
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert keep_chunk_buffers(1 << 20) is glibc
    assert keep_chunk_buffers(1 << 18) is glibc  # a smaller chunk keeps the higher threshold
    assert keep_chunk_buffers(1 << 30) is glibc  # capped at glibc's own ceiling


def test_the_malloc_arena_cap_is_set_once_and_leaves_the_environment_alone():
    """broker.malloc_arena_max: mallopt(M_ARENA_MAX) where glibc is there, nothing when the
    operator's MALLOC_ARENA_MAX (applied by glibc itself) is set or the cap is 0."""
    code = ("import json, os; from graft_fed.broker.heap import limit_malloc_arenas;"
            "print(json.dumps([limit_malloc_arenas(0), limit_malloc_arenas(2)]))")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert plain.returncode == 0, plain.stderr
    zero, two = json.loads(plain.stdout.strip().splitlines()[-1])
    assert zero is False
    assert two is (platform.libc_ver()[0] == "glibc")
    env["MALLOC_ARENA_MAX"] = "4"
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert theirs.returncode == 0, theirs.stderr
    assert json.loads(theirs.stdout.strip().splitlines()[-1]) == [False, False]


_TRIM = """
import json, os
from graft_fed.broker.heap import trim_heap
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
blocks = [bytes(2000) for _ in range(50_000)]  # ~100 MiB from glibc's heap (above pymalloc's 512 bytes)
keep = blocks[::64]  # live blocks across the heap: its top cannot shrink when the rest is freed
del blocks
before = rss()
released = trim_heap()
print(json.dumps([released, (before - rss()) / 2**20]))
"""


def test_trim_heap_gives_free_pages_inside_the_heap_back():
    """broker.malloc_trim_s: what the housekeeping calls. 98% of 100 MiB freed between live
    blocks stays in the process (RSS) until malloc_trim(0) hands its pages back."""
    out = subprocess.run([sys.executable, "-c", _TRIM], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    released, mib = json.loads(out.stdout.strip().splitlines()[-1])
    if platform.libc_ver()[0] != "glibc":
        assert released is False
        return
    assert released is True
    assert mib > 50, f"RSS fell by only {mib:.1f} MiB"


_USAGE = """
import ctypes, json, sqlite3
from graft_fed.broker.heap import memory_usage
before = memory_usage()
held = [ctypes.create_string_buffer(4000) for _ in range(10_000)]  # ~40 MiB live in malloc's heap
conn = sqlite3.connect(":memory:")
conn.execute("CREATE TABLE t (x BLOB)")
conn.executemany("INSERT INTO t VALUES (?)", [(bytes(1000),)] * 2000)  # ~2 MiB of pages in SQLite's cache
after = memory_usage()
del held
freed = memory_usage()
print(json.dumps([before, after, freed]))
"""


def test_memory_usage_tells_live_c_memory_and_sqlite_apart():
    """graft_fed_broker_memory_bytes: 40 MiB held through malloc shows as in use and then,
    freed, as free or returned; an SQLite database's pages show as SQLite's; RSS follows."""
    out = subprocess.run([sys.executable, "-c", _USAGE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after, freed = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2**20
    assert after["python_blocks"] > 0
    assert after["sqlite"] - before["sqlite"] > 1 * mib
    if platform.system() == "Linux":
        assert after["resident_anon"] - before["resident_anon"] > 30 * mib
        assert after["threads"] >= 1
    if platform.libc_ver()[0] == "glibc":
        assert after["malloc_in_use"] - before["malloc_in_use"] > 35 * mib
        assert after["malloc_in_use"] - freed["malloc_in_use"] > 35 * mib


GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def test_without_tcache_adds_the_tunable_once_and_leaves_the_operators_choice_alone():
    from graft_fed.broker.heap import TCACHE_OFF, tcache_off, without_tcache

    env = without_tcache({"A": "1"})
    if not GLIBC:
        assert env is None and not tcache_off({"GLIBC_TUNABLES": TCACHE_OFF})
        return
    assert env == {"A": "1", "GLIBC_TUNABLES": TCACHE_OFF} and tcache_off(env)
    other = without_tcache({"GLIBC_TUNABLES": "glibc.malloc.mxfast=0"})
    assert other["GLIBC_TUNABLES"] == f"glibc.malloc.mxfast=0:{TCACHE_OFF}" and tcache_off(other)
    assert without_tcache(env) is None  # the re-executed process: no second round
    assert without_tcache({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=3"}) is None  # the operator's
    assert not tcache_off({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=3"}) and not tcache_off({})


@pytest.mark.skipif(not GLIBC, reason="glibc's tunables")
def test_graft_fed_broker_runs_itself_again_with_glibcs_caches_off(prompt_file, tmp_path):
    """`graft-fed broker` re-executes itself once, in the same process, with
    GLIBC_TUNABLES=glibc.malloc.tcache_count=0 added (broker.malloc_tcache: false, the
    default); not with malloc_tcache: true, and not over an operator's own tcache_count."""
    import socket
    import time

    import yaml

    def environ(pid: int) -> dict[str, str]:
        raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        return dict(item.decode().split("=", 1) for item in raw if b"=" in item)

    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    cases = [({}, base, "glibc.malloc.tcache_count=0", "off"),
             ({"malloc_tcache": True}, base, None, "on"),
             ({}, {**base, "GLIBC_TUNABLES": "glibc.malloc.tcache_count=3"}, "glibc.malloc.tcache_count=3", "on")]
    for i, (extra, env, tunables, said) in enumerate(cases):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cfg = {"listen": f"127.0.0.1:{port}", "http": "", "db": str(tmp_path / f"b{i}.sqlite"),
               "data": {"source": str(prompt_file)}, "verifier": {"name": "tests.plugins:odd_char_sum"},
               "n": 2, "prompts_per_round": 4, **extra}
        (tmp_path / f"b{i}.yaml").write_text(yaml.safe_dump(cfg))
        port_file, log = tmp_path / f"port{i}", tmp_path / f"log{i}"
        with log.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "graft_fed.cli", "broker",
                                     "--config", str(tmp_path / f"b{i}.yaml"), "--port-file", str(port_file)],
                                    stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 60
            while not port_file.exists():
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the broker did not start"
                time.sleep(0.05)
            assert environ(proc.pid).get("GLIBC_TUNABLES") == tunables  # the same process, run again
            assert f"glibc's per-thread caches {said}" in log.read_text()
        finally:
            proc.terminate()
            assert proc.wait(60) == 0, log.read_text()


def test_a_program_calling_main_keeps_its_process(tmp_path, monkeypatch, capsys):
    """graft_fed.cli.main(["broker", ...]) from a program (a test, a notebook) never runs the
    caller's process again: only the command itself re-executes (a pytest process that
    called it was replaced by a second pytest, whose report went into a capture file)."""
    from graft_fed import cli

    calls = []
    monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    (tmp_path / "pf").write_text("a file, not a folder: the broker refuses to start")
    assert cli.main(["broker", "--set", "listen=127.0.0.1:0", "--set", "http=127.0.0.1:0",
                     "--set", f"db={tmp_path / 'pf' / 'b.sqlite'}"]) == 2
    assert calls == []
    # the command itself (argv from the command line) does, where glibc is
    monkeypatch.setattr(sys, "argv", ["graft-fed", "broker", "--set", "listen=127.0.0.1:0", "--set", "http=127.0.0.1:0",
                                      "--set", f"db={tmp_path / 'pf' / 'b.sqlite'}"])
    assert cli.main() == 2
    assert len(calls) == (1 if GLIBC else 0)
    if calls:
        assert calls[0][2]["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0"
    capsys.readouterr()
