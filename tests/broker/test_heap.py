"""broker/heap.py: the C heap's arenas, its thresholds for chunk-sized buffers, the caches,
and protobuf's malloc_trim calls."""

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
        # port 0: the port it got is written to --port-file
        cfg = {"listen": "127.0.0.1:0", "http": "", "db": str(tmp_path / f"b{i}.sqlite"),
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
            assert (tmp_path / f"b{i}.sqlite").exists()  # its state where the config says, not in the checkout
            assert environ(proc.pid).get("GLIBC_TUNABLES") == tunables  # the same process, run again
            assert f"glibc's per-thread caches {said}" in log.read_text()
            assert "protobuf's malloc_trim calls declined" in log.read_text()
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


_PROTOBUF_TRIMS = """
import ctypes, json, os, sys
from graft_fed.broker.heap import _libc, _load_bias, decline_protobuf_trims, got_slots
from graft_fed.proto import broker_pb2 as pb
from google._upb import _message


def churn(count):  # each message's arena gives its blocks back through upb's allocator
    for i in range(count):
        pb.HeartbeatRequest.FromString(pb.HeartbeatRequest(node_id="n" * (i % 40), round=i).SerializeToString())


def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


churn(20_000)  # protobuf has called malloc_trim by now, so its GOT slot holds glibc's
path = os.path.realpath(_message.__file__)
slots = got_slots(path, "malloc_trim")
address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value
held_before = [ctypes.c_void_p.from_address(_load_bias(path) + s).value for s in slots]
said = decline_protobuf_trims() if sys.argv[1] == "decline" else "let through"
held_after = [ctypes.c_void_p.from_address(_load_bias(path) + s).value for s in slots]
malloc, free = _libc("malloc"), _libc("free")
malloc.restype = ctypes.c_void_p
blocks = [malloc(16384) for _ in range(8000)]  # 125 MiB of the C heap, touched
for b in blocks:
    ctypes.memset(b, 1, 16384)
for b in blocks[::2]:  # half of it free between live blocks: pages malloc_trim would hand back
    free(ctypes.c_void_p(b))
before = rss()
churn(20_000)
print(json.dumps({"said": said, "slots": len(slots), "held_before": [h == address(_libc("malloc_trim")) for h in held_before],
                  "held_after": [h == address(_libc("abs")) for h in held_after], "rss_fell_mib": (before - rss()) / 2**20}))
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc_trim")
def test_protobufs_malloc_trim_calls_are_declined():
    """broker.protobuf_malloc_trim: false. Let through, protobuf's upb extension hands the
    free pages inside the heap back every 10,000 arena blocks it frees (RSS falls by the
    whole pages of the 62 MiB freed between live blocks, about 47 MiB); declined, its GOT slot for malloc_trim, which held
    glibc's malloc_trim (so the slot and the load address were read right), holds abs()
    and RSS stays."""
    runs = {}
    for mode in ("let", "decline"):
        out = subprocess.run([sys.executable, "-c", _PROTOBUF_TRIMS, mode], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    let, declined = runs["let"], runs["decline"]
    if let["slots"] == 0:  # a protobuf that no longer calls it: nothing to decline
        assert declined["said"].startswith("nothing to decline")
        return
    assert let["held_before"] == [True] * let["slots"] and let["held_after"] == [False] * let["slots"]
    assert let["rss_fell_mib"] > 30, let
    assert declined["said"] == "declined" and declined["held_after"] == [True] * declined["slots"]
    assert abs(declined["rss_fell_mib"]) < 5, declined


def test_got_slots_reads_only_64_bit_elf(tmp_path):
    import struct

    from graft_fed.broker.heap import got_slots

    (tmp_path / "x.so").write_bytes(b"#!/bin/sh\n" * 10)
    assert got_slots(str(tmp_path / "x.so"), "malloc_trim") == []
    (tmp_path / "short.so").write_bytes(b"\x7fELF\x02\x01" + bytes(40))  # a header cut short
    with pytest.raises(struct.error):  # decline_protobuf_trims says so and changes nothing
        got_slots(str(tmp_path / "short.so"), "malloc_trim")
