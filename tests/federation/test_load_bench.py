"""bench/broker/load.py at a tiny size, so the load benchmark cannot rot: 4 nodes x 16
summaries over mutual TLS for a few seconds, the broker SIGKILLed and restarted on its
SQLite file in the middle; nothing acknowledged lost or duplicated, results written."""

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_load_bench_survives_a_broker_restart_with_nothing_lost(tmp_path):
    # 8.5 s after the restart: a restarted broker (a fresh Python process) can take seconds to
    # start on a loaded 2-core machine, and the nodes must see it come back
    args = ["--nodes", "4", "--prompts", "16", "--duration", "10", "--restart-at", "1.5", "--procs", "1",
            "--train-s", "0.05", "--sample-s", "0.5", "--memory-s", "1", "--rpc-timeout-s", "5", "--match-wait-s", "1", "--backoff-cap-s", "0.5",
            "--out-dir", str(tmp_path), "--name", "tiny"]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "broker" / "load.py"), *args],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "tiny.json").read_text())
    v = res["verify"]
    assert res["nodes_reporting"] == 4
    assert v["acknowledged_summaries"] > 0 and v["acknowledged_summaries"] % 16 == 0
    assert v["lost"] == 0 and v["duplicate_keys"] == 0 and v["extra_rows_in_acknowledged_rounds"] == 0
    assert v["published_count_mismatch"] == {}
    assert v["rows"] == v["acknowledged_summaries"] + v["rows_never_acknowledged"]
    assert v["rounds_matched"] >= 1
    # the broker really was killed and came back, and the nodes carried on against the new one
    assert len(res["rss_per_life"]) == 2
    assert res["restart"]["publishes_acknowledged_after"] > 0
    assert res["latency"]["PublishSummaries"]["count"] > 0
    assert (tmp_path / "tiny.md").read_text().startswith("### Broker load: 4 nodes x 16 summaries")
    assert "each node waits 0.05 s (its training) between its matches" in (tmp_path / "tiny.md").read_text()
    # the probe node ran alone in its process; its heartbeats carry the broker's timing
    assert res["probe_nodes"] == ["node03"]
    probe = res["heartbeats"]["probe"]
    assert probe["calls"] > 0 and probe["timed_by_broker"] == probe["calls"]
    assert res["heartbeats"]["simulated"]["calls"] > 0
    assert res["rss_flat_after_warmup"] is None  # no life lasted past its warm-up
    # where the broker's memory is, read from its /metrics in both lives
    assert {m["life"] for m in res["memory"]} == {0, 1}
    last = res["memory"][-1]["memory"]
    assert last["sqlite"] > 0 and last["replay_request_ids"] > 0 and last["resident_anon"] > 0
    # the publish queue's counters, read with it, and its table per window of a life's age
    # the queue counts a publish when it has run it, the RPC histogram when its answer has gone:
    # a sample taken between the two sees at most one publish per node not yet in the histogram
    in_flight = res["nodes_reporting"]
    assert last["publish_batched_total"] > 0 and last["publish_rpc_count"] >= last["publish_batched_total"] - in_flight
    assert last["publish_busy_seconds_total"] > 0 and last["publish_waited_seconds_total"] >= 0
    rows = res["publish_queue_per_life"][-1]  # the second life: the first lasts too short for two samples
    assert rows and rows[0]["publishes"] > 0 and rows[0]["busy"] > 0
    assert "The publish queue, life 1, in windows of 60 s" in (tmp_path / "tiny.md").read_text()
    # --render recomputes the summaries from the samples and writes the same report
    md = (tmp_path / "tiny.md").read_text()
    (tmp_path / "tiny.md").unlink()
    again = subprocess.run([sys.executable, str(ROOT / "bench" / "broker" / "load.py"), "--render",
                            str(tmp_path / "tiny.json")], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "tiny.md").read_text() == md


def _load_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("load_bench", ROOT / "bench" / "broker" / "load.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_windows_report_each_kinds_slope_per_window_of_age():
    load = _load_module()
    # 40 minutes of samples every 10 s: 2 MiB/min until age 1500 s, then flat
    ages = [10.0 * i for i in range(241)]
    mib = [100 + 2 * min(a, 1500) / 60 for a in ages]
    ws = load.windows_of([(a, m) for a, m in zip(ages, mib) if a >= 300], 300, 600)
    assert [(w["from_s"], round(w["slope_per_min"], 6)) for w in ws] == [(300, 2.0), (900, 2.0), (1500, 0.0),
                                                                          (2100, 0.0)]
    samples = [{"life": 0, "age": a, "memory": {"malloc_in_use": m * 2**20, "process_threads": 300.0}}
               for a, m in zip(ages, mib)]
    life = load.memory_lives(samples, 1, 300, 600)[0]
    assert [round(w["slope_per_min"], 6) for w in life["malloc_in_use"]["windows"]] == [2.0, 2.0, 0.0, 0.0]
    assert life["process_threads"]["windows"][-1]["last"] == 300.0
    assert "windows" not in load.memory_lives(samples, 1, 300)[0]["malloc_in_use"]  # only when asked


def test_queue_windows_turn_the_counters_into_rates_per_window_of_age():
    load = _load_module()
    # 3 minutes of samples every 10 s: 100 publishes/s in batches of 4, the thread busy half
    # the time until age 60, then fully, each publish waiting 20 ms, a whole call 30 ms
    samples, busy = [], 0.0
    for i in range(19):
        age = 10.0 * i
        busy += 0 if i == 0 else (5.0 if age <= 60 else 10.0)
        n = 1000.0 * i
        samples.append({"life": 0, "age": age, "memory": {
            "publish_batches_total": n / 4, "publish_batched_total": n, "publish_busy_seconds_total": busy,
            "publish_waited_seconds_total": 0.02 * n, "publish_rpc_sum": 0.03 * n, "publish_rpc_count": n,
            "publish_queue_waiting": 3.0}})
    samples.append({"life": 1, "age": 5.0, "memory": {"malloc_in_use": 1.0}})  # no counters: no rows
    rows = load.queue_windows(samples, 2, 60.0)
    assert rows[1] == []
    assert [(r["from_s"], r["to_s"]) for r in rows[0]] == [(0, 50), (60, 110), (120, 170)]
    first, second = rows[0][0], rows[0][1]
    assert first["publishes"] == 5000 and first["per_s"] == 100 and first["mean_batch"] == 4
    assert first["busy"] == 0.5 and first["work_ms"] == pytest.approx(5.0)
    assert second["busy"] == pytest.approx(1.0) and second["work_ms"] == pytest.approx(10.0)
    assert first["wait_ms"] == pytest.approx(20) and first["rpc_ms"] == pytest.approx(30)
    assert first["waiting_mean"] == 3.0
    # counters are no memory: the per-life kinds leave them out
    assert set(load.memory_lives(samples, 1, 0)[0]) == {"publish_queue_waiting"}


def test_the_heap_size_and_the_anonymous_memory_outside_it_are_derived():
    load = _load_module()
    mib = 2**20
    samples = [{"life": 0, "age": a, "memory": {"malloc_in_use": (80 + a % 20) * mib, "malloc_free": (20 - a % 20) * mib,
                                                 "malloc_mmapped": 4 * mib, "resident_anon": (150 + a / 60) * mib}}
               for a in range(0, 600, 10)]
    life = load.memory_lives(samples, 1, 300)[0]
    # in use and free swing against each other: the heap holds 100 MiB throughout
    assert life["heap_size"]["first"] == life["heap_size"]["last"] == 100
    assert life["heap_size"]["slope_per_min_after_warmup"] == pytest.approx(0, abs=1e-9)
    # what is resident beyond the heap and its mapped blocks grows 1 MiB/min
    assert life["anon_outside_heap"]["first"] == pytest.approx(46)
    assert life["anon_outside_heap"]["slope_per_min_after_warmup"] == pytest.approx(1.0)
    assert "heap_size" not in load.with_derived({"resident_anon": 1.0})  # nothing to derive it from


def test_the_rss_verdict_says_when_the_slope_is_too_uncertain_to_tell():
    import random

    load = _load_module()
    rng = random.Random(7)

    def churn(n: int, sigma: float, rho: float) -> list[float]:  # AR(1): each sample leans on the last
        out, e = [], 0.0
        for _ in range(n):
            e = rho * e + rng.gauss(0, sigma)
            out.append(e)
        return out

    line = [(2.0 * i, 200 + 0.5 * (2.0 * i) / 60) for i in range(90)]
    assert abs(load.slope(line) - 0.5) < 1e-9 and load.slope_se(line) < 1e-6
    assert load.decided(0.5, 0.0, 0.7) and load.decided(2.0, 0.1, 0.7) and not load.decided(0.5, 0.2, 0.7)
    # the same noise, independent or following itself: the second says less about the trend
    white = [(2.0 * i, 200 + e) for i, e in enumerate(churn(90, 5.0, 0.0))]
    leaning = [(2.0 * i, 200 + e) for i, e in enumerate(churn(90, 5.0 * (1 - 0.8 ** 2) ** 0.5, 0.8))]
    assert load.slope_se(leaning) > 1.4 * load.slope_se(white)  # r = 0.8: 3x in theory; r is estimated low from 90 samples

    def life(seconds: float, sigma: float) -> dict:
        ages = [2.0 * i for i in range(int(seconds / 2))]
        samples = [{"life": 0, "age": a, "rss_kib": (250 + e) * 1024} for a, e in zip(ages, churn(len(ages), sigma, 0.9))]
        return load.rss_lives(samples, 1, 300)[0]["after_warmup"]

    # 180 s past the warm-up with a heap churning by ~10 MiB: a flat broker cannot be shown flat
    short = life(480, 4.0)
    assert short["span_s"] >= 170 and 2 * short["slope_se_mib_per_min"] > short["flat_limit_mib_per_min"]
    assert short["decided"] is False
    # the same broker for 40 minutes with the heap churning little: shown flat
    long = life(2700, 0.5)
    assert long["flat"] is True and long["decided"] is True
    payload = {"rss": [{"life": 0, "age": 2.0 * i, "rss_kib": (250 + 0.01 * i) * 1024} for i in range(1350)]}
    load.per_life(payload, 1, 300, load.WINDOW_S)
    assert payload["rss_flat_after_warmup"] is True and payload["rss_verdict_decided"] is True
    assert load.verdict(True, False).startswith("not shown (the slope is within the limit")
    assert load.verdict(False, True) == "no" and load.verdict(True, None) == "yes"


def test_render_with_other_windows_and_back_and_bad_widths(tmp_path):
    load = _load_module()
    ages = [10.0 * i for i in range(121)]
    payload = {"machine": {"date": "d", "nproc": 2, "cpu": "c", "python": "p", "grpc": "g", "git": ""},
               "command": "c", "args": {"nodes": 2, "prompts": 4, "duration": 1200, "restart_at": [-1], "procs": 1,
                                        "probes": 1, "warmup_s": 300.0},
               "rss": [{"t": a, "life": 0, "age": a, "rss_kib": 1024 * (100 + a / 60), "load1": 1.0} for a in ages],
               "memory": [{"t": a, "life": 0, "age": a, "memory": {"malloc_in_use": 2**20 * (50 + a / 60)}}
                          for a in ages]}
    src = tmp_path / "r.json"
    src.write_text(json.dumps(payload))
    md = load.markdown  # the report's body needs more than these fields: test the parts render fills
    wide, default = tmp_path / "w.md", tmp_path / "d.md"
    load.markdown = lambda p: f"window_s={p.get('window_s')} rss={p['rss_per_life'][0]['after_warmup']['windows']} " \
                              f"mem={p['memory_per_life'][0]['malloc_in_use'].get('windows')}"
    try:
        assert load.render(src, 600, wide) == 0 and load.render(src, None, default) == 0
        # a result that already says 600 s, rendered back at the default, is the default's report
        src.write_text(json.dumps({**payload, "window_s": 600.0}))
        assert load.render(src, 120.0, tmp_path / "back.md") == 0
    finally:
        load.markdown = md
    assert wide.read_text().startswith("window_s=600") and "mem=[{" in wide.read_text()
    assert default.read_text().startswith("window_s=None") and "mem=None" in default.read_text()
    assert (tmp_path / "back.md").read_text() == default.read_text()
    for bad in ("0", "-60", "nan", "inf", "x"):
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "broker" / "load.py"), "--render", str(src),
                               "--window-s", bad], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "--window-s" in proc.stderr, (bad, proc.stderr[-500:])


def test_load_bench_plaintext_runs_the_same_load_without_tls(tmp_path):
    """`--plaintext` (a diagnosis of what mutual TLS costs): the broker gets no certificates,
    the nodes plaintext channels, and the load and its checks are the same. With
    `--reports` the nodes also report on the groups they were offered, and the broker
    stores those reports."""
    args = ["--nodes", "3", "--prompts", "8", "--duration", "4", "--restart-at", "-1", "--procs", "1",
            "--sample-s", "0.5", "--memory-s", "0", "--rpc-timeout-s", "5", "--match-wait-s", "1", "--backoff-cap-s", "0.5",
            "--plaintext", "--reports", "--keep", "--out-dir", str(tmp_path), "--name", "plain"]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "broker" / "load.py"), *args],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "plain.json").read_text())
    v = res["verify"]
    assert v["acknowledged_summaries"] > 0 and v["lost"] == 0 and v["duplicate_keys"] == 0
    md = (tmp_path / "plain.md").read_text()
    assert "- plaintext (no TLS: a diagnosis) on 127.0.0.1" in md
    assert "- each node reports on every group it was offered" in md
    assert res["latency"]["ReportCompatibility"]["count"] > 0
    assert not any(k.startswith("ReportCompatibility") for k in res["errors"]), res["errors"]
    work = Path(proc.stdout.split("work directory ", 1)[1].split()[0])
    try:
        broker_cfg = (work / "broker.yaml").read_text()
        assert "tls_cert" not in broker_cfg and "client_ca" not in broker_cfg
        dbs = list(work.rglob("*.sqlite")) + list(work.rglob("*.db"))
        with sqlite3.connect(dbs[0]) as conn:
            (reports,), = conn.execute("SELECT COALESCE(SUM(count), 0) FROM report_blocks").fetchall()
        assert reports > 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_a_broker_with_a_front_is_judged_with_it():
    """With `front_process: true` gRPC core's memory lives in the front, a child of the
    broker: a broker flat on its own but whose front grows is not flat; the report shows
    both, and without children it stays as it was."""
    load = _load_module()
    samples = [{"t": 2.0 * i, "life": 0, "age": 2.0 * i, "rss_kib": 250 * 1024, "load1": 1.0,
                "children_rss_kib": int((100 + 0.1 * i) * 1024)} for i in range(1350)]  # front: +3 MiB/min
    payload = {"rss": samples}
    load.per_life(payload, 1, 300, load.WINDOW_S)
    assert payload["rss_per_life"][0]["after_warmup"]["flat"] is True        # the broker alone
    service = payload["service_rss_per_life"][0]["after_warmup"]
    assert service["flat"] is False and abs(service["slope_mib_per_min"] - 3.0) < 0.01
    assert payload["rss_flat_after_warmup"] is False and payload["rss_verdict_decided"] is True
    table = load.rss_table(payload["service_rss_per_life"])
    assert len(table) == 3 and table[2].startswith("| 0 | 2698 | 350.0 |") and table[2].endswith("| no |")
    for s in samples:
        del s["children_rss_kib"]
    load.per_life(payload, 1, 300, load.WINDOW_S)
    assert "service_rss_per_life" not in payload and payload["rss_flat_after_warmup"] is True


def test_children_rss_is_read_from_proc():
    load = _load_module()
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(32 << 20); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            kib = load.children_rss_kib(os.getpid())
            if kib is not None and kib >= 32 * 1024:
                break
            time.sleep(0.1)
        assert kib is not None and kib >= 32 * 1024, kib
    finally:
        child.kill()
        child.wait()
    assert load.children_rss_kib(2**22 + 12345) is None  # no such process


def test_rss_tables_name_each_life_by_its_number():
    """A life with no sample of its own (here: no child process sampled in life 0, which
    ended before its front started) is left out of a table, and the rows after it keep their
    lives' numbers rather than their positions."""
    load = _load_module()
    early = [{"t": 2.0 * i, "life": 0, "age": 2.0 * i, "rss_kib": 80 * 1024, "load1": 1.0} for i in range(3)]
    later = [{"t": 10.0 + 2.0 * i, "life": 1, "age": 2.0 * i, "rss_kib": 250 * 1024, "load1": 1.0,
              "children_rss_kib": 100 * 1024} for i in range(300)]
    payload = {"rss": early + later}
    load.per_life(payload, 2, 300, load.WINDOW_S)
    assert [l["life"] for l in payload["rss_per_life"]] == [0, 1]
    assert [l["life"] for l in payload["service_rss_per_life"]] == [1]
    assert load.rss_table(payload["service_rss_per_life"])[2].startswith("| 1 | 598 | 350.0 |")


def _pool_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("pool_probes", ROOT / "bench" / "broker" / "pool_probes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pool_probes_pools_runs_and_tests_the_share_over_the_limit(tmp_path):
    pool = _pool_module()
    # Fisher's exact test against known values: the lady tasting tea (3 of 4 against 1 of 4)
    # and a table as lopsided as it can be with its margins
    assert abs(pool.fisher_two_sided(3, 4, 1, 4) - 0.4857142857) < 1e-9
    assert abs(pool.fisher_two_sided(4, 4, 0, 4) - 2 / 70) < 1e-12
    assert pool.fisher_two_sided(0, 100, 0, 100) == 1.0

    def result(name, trips_ms):
        # a load.py result as pool_probes reads it: per probe, beats of five stamps (s)
        beats = [[10.0 + i, 0, 0, 0, 10.0 + i + t / 1e3] for i, t in enumerate(trips_ms)]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"probe_beats": {"node9": beats}}))
        return str(path)

    fast = [result(f"fast{i}", [5.0] * 98 + [50.0] * 2) for i in range(2)]
    slow = [result(f"slow{i}", [5.0] * 90 + [150.0] * 10) for i in range(2)]
    out = tmp_path / "pooled.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "broker" / "pool_probes.py"), "--group", "a", *fast,
                           "--group", "b", *slow, "--reps", "200", "--json", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    a, b = ({k: v if isinstance(v, int) else pytest.approx(v, abs=1e-6) for k, v in res["groups"][g]["pooled"].items()}
            for g in "ab")
    assert (a["count"], a["p50_ms"], a["p99_ms"], a["over_limit"]) == (200, 5.0, 50.0, 0)
    assert (b["count"], b["p90_ms"], b["p99_ms"], b["over_limit"]) == (200, 5.0, 150.0, 20)
    assert res["groups"]["b"]["pooled"]["p99_ci95_ms"] == pytest.approx([150.0, 150.0])
    lo, hi = res["groups"]["a"]["pooled"]["p99_ci95_ms"]
    assert lo <= 50.0 + 1e-6 and hi >= 50.0 - 1e-6
    assert res["over_limit_fisher_p"] < 1e-5
    assert "over 100 ms: a 0 of 200, b 20 of 200" in proc.stdout
    # a file that is not a load.py result says so
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "broker" / "pool_probes.py"), "--group", "a",
                           str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "no probe_beats" in proc.stderr


def test_every_result_says_how_fast_the_machine_ran():
    """The same "AMD EPYC" ran the same broker at half the speed on another day (issue 13,
    fifty-seventh pass); the broker's own latencies are not ratios to a baseline of their run,
    so each result records the machine's speed at its start, and its report says it."""
    _load_module()  # puts bench/broker on the path
    import _common

    speed = _common.machine_speed(reps=1)
    assert set(speed) == {"python_loop_ms", "sqlite_read_us", "sha256_16mib_ms", "thread_handoff_us"}
    assert all(isinstance(v, float) and 0 < v < 60_000 for v in speed.values()), speed
    info = {"nproc": 2, "cpu": "c", "python": "3.11", "grpc": "1.85", "git": "abc", "speed": speed}
    line = _common.machine_line(info)
    assert line.startswith("Machine: 2 CPUs (c), Python 3.11, grpcio 1.85, git abc; its speed at the start")
    assert f"{speed['sqlite_read_us']:.2f} us" in line and line.endswith(f"{speed['thread_handoff_us']:.1f} us.")
    assert _common.machine_line({**info, "speed": None}) == "Machine: 2 CPUs (c), Python 3.11, grpcio 1.85, git abc."
