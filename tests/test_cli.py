"""The CLI end to end on tiny local models (no network): train, resume, eval on a benchmark
file, score, plot, store, and clear errors for bad input."""

import json
import time
from pathlib import Path

import yaml

from graft_fed.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "benchmarks"


def _train_cfg(tmp_path, model, prompt_file, steps=2):
    cfg = {"run": {"output_dir": str(tmp_path / "run"), "steps": steps, "device": "cpu", "threads": 1,
                   "checkpoint_every": 1},
           "model": {"path": str(model)}, "data": {"source": str(prompt_file)},
           "rollout": {"n": 2, "max_new_tokens": 4}, "verifier": {"name": "tests.plugins:odd_char_sum"},
           "algorithm": {"prompts_per_step": 4, "num_minibatches": 2},
           "eval": {"data": {"source": str(prompt_file), "max_prompts": 2}, "k": 2}}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_train_resume_plot_store(tiny_llama, prompt_file, tmp_path, capsys):
    cfg = _train_cfg(tmp_path, tiny_llama, prompt_file)
    assert main(["train", "--config", str(cfg), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "held-out pass@1" in out and "before" in out
    assert main(["train", "--config", str(cfg), "--quiet", "--resume", "--set", "run.steps=3", "--no-eval"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r] == [1, 2, 3]
    assert main(["plot", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "plots" / "learning_curves.png").stat().st_size > 1000
    store = tmp_path / "run" / "trajectories.sqlite"
    assert main(["store", "export", str(store), str(tmp_path / "groups.jsonl")]) == 0
    assert len((tmp_path / "groups.jsonl").read_text().splitlines()) == 3 * 4
    assert main(["store", "import", str(tmp_path / "groups.jsonl"), str(tmp_path / "copy.sqlite")]) == 0


def test_eval_on_a_benchmark_file_by_name(tiny_llama, tmp_path, capsys):
    rc = main(["eval", "--model", str(tiny_llama), "--benchmark", "math500", "--benchmarks-dir", str(FIXTURES),
               "-k", "2", "--max-new-tokens", "4", "--device", "cpu", "--out", str(tmp_path / "ev")])
    assert rc == 0
    summary = json.loads((tmp_path / "ev" / "math500.summary.json").read_text())
    # the third fixture problem (800 characters) does not fit the tiny model's 512 positions
    assert summary["k"] == 2 and summary["n_prompts"] == 2 and 0.0 <= summary["pass@1"] <= 1.0
    assert summary["skipped_prompts"] == 1
    rows = (tmp_path / "ev" / "math500.jsonl").read_text().splitlines()
    assert len(rows) == 2 and len(json.loads(rows[0])["responses"]) == 2


def test_score_command(tmp_path, capsys):
    (tmp_path / "r.jsonl").write_text('{"id": "a", "response": "so \\\\boxed{4}"}\n{"id": "b", "response": "5"}\n')
    (tmp_path / "g.jsonl").write_text('{"id": "a", "answer": "4"}\n{"id": "b", "answer": "5"}\n')
    assert main(["score", "--responses", str(tmp_path / "r.jsonl"), "--references", str(tmp_path / "g.jsonl"),
                 "--out", str(tmp_path / "s.jsonl")]) == 0
    scored = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [s["reward"] for s in scored] == [1.0, 0.0]  # "5" has no boxed answer


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  stepz: 3\n")
    assert main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'run.stepz'" in err and "did you mean 'steps'" in err
    assert main(["train", "--set", "run.steps"]) == 2
    assert "expected section.key=value" in capsys.readouterr().err
    assert main(["eval", "--model", "zoo:nope", "--benchmark", "math500"]) == 2
    assert "GRAFT_FED_BENCHMARKS_DIR" in capsys.readouterr().err  # says how to point at the files
    assert main(["eval", "--model", "zoo:nope", "--benchmark", "math500", "--benchmarks-dir", str(FIXTURES)]) == 2
    assert "unknown zoo model" in capsys.readouterr().err


def test_user_errors_are_one_line_and_non_zero(tmp_path, capsys, monkeypatch):
    """The user errors of issue 14: each exits 2 with `graft-fed CMD: error: ...` and no traceback."""
    def check(argv, *needles):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.startswith(f"graft-fed {argv[0]}: error: "), err
        for needle in needles:
            assert needle in err, (needle, err)

    check(["eval", "--model", str(tmp_path / "missing"), "--benchmark", "math500", "--benchmarks-dir", str(FIXTURES),
           "--device", "cpu"], "the directory", "does not exist")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id that is not cached, without waiting on the network
    check(["eval", "--model", "someorg/not-a-model", "--benchmark", "math500", "--benchmarks-dir", str(FIXTURES),
           "--device", "cpu"], "not in the hub cache")
    check(["certs", "issue", "--dir", str(tmp_path / "ca"), "--name", "n1", "--days", "-1"], "at least one day")
    check(["broker", "nodes", "add", "--allowlist", str(tmp_path / "no" / "allow.yaml"), "n1"], "does not exist")
    check(["broker", "nodes", "list", "--allowlist", str(tmp_path / "allow.yaml")], "does not exist")
    (tmp_path / "r.jsonl").write_text('{"id": "a", "response": "\\\\boxed{1}"}\n{"id": "zz", "response": "x"}\n')
    (tmp_path / "g.jsonl").write_text('{"id": "a", "answer": "1"}\n')
    check(["score", "--responses", str(tmp_path / "r.jsonl"), "--references", str(tmp_path / "g.jsonl")],
          "1 response id(s) have no reference", "'zz'", "--allow-missing")
    assert main(["score", "--responses", str(tmp_path / "r.jsonl"), "--references", str(tmp_path / "g.jsonl"),
                 "--allow-missing"]) == 0
    assert json.loads(capsys.readouterr().out)["missing_references"] == 1


def test_broker_nodes_on_a_bad_allowlist_is_an_error_and_leaves_the_file(tmp_path, capsys):
    """A hand-edited allowlist the broker would refuse: every `broker nodes` command says what
    is wrong (key, file, what to write) and exits 2, no traceback, no letters listed as names,
    the file untouched."""
    path = tmp_path / "allow.yaml"
    for raw, needle in ((b"allowed: [alice, mallory]\nrevoked: mallory\n", "revoked: [mallory]"),
                        (b"allowed: alice\n", "allowed: [alice]"),
                        (b"allowed: [alice, 007]\n", "quote it: '007'"),
                        (b"allowed: [alice, \xe9ve]\n", "not UTF-8"),
                        (b"- alice\n", "the top level is a list")):
        path.write_bytes(raw)
        for argv in (["list"], ["add", "bob"], ["revoke", "alice"], ["release", "alice"]):
            assert main(["broker", "nodes", argv[0], "--allowlist", str(path), *argv[1:]]) == 2, (raw, argv)
            out, err = capsys.readouterr()
            assert out == "" and "Traceback" not in err and err.startswith("graft-fed broker: error: allowlist "), err
            assert str(path) in err and needle in err, (needle, err)
            assert path.read_bytes() == raw
    assert sorted(p.name for p in tmp_path.iterdir()) == ["allow.yaml"]


def test_broker_on_a_taken_port_is_an_error(tmp_path, capsys):
    from graft_fed.broker.config import load_broker_config
    from graft_fed.broker.server import BrokerServer

    first = BrokerServer(load_broker_config(None, {"listen": "127.0.0.1:0", "http": "127.0.0.1:0",
                                                   "db": str(tmp_path / "a.sqlite")})).start()
    try:
        taken_grpc = first.address
        assert main(["broker", "--set", f"listen={taken_grpc}", "--set", "http=127.0.0.1:0",
                     "--set", f"db={tmp_path / 'b.sqlite'}"]) == 2
        assert "cannot listen for gRPC on " + taken_grpc in capsys.readouterr().err
        assert main(["broker", "--set", "listen=127.0.0.1:0", "--set", f"http=127.0.0.1:{first.http_port}",
                     "--set", f"db={tmp_path / 'c.sqlite'}"]) == 2
        assert "cannot serve HTTP" in capsys.readouterr().err
    finally:
        first.stop()


def test_eval_fits_the_model_context_shows_progress_and_a_table(tiny_gpt2, tmp_path, capsys):
    """A 512-position model asked for more new tokens than it has positions: capped, and a
    prompt longer than half the context is skipped and counted, not an IndexError."""
    bench = tmp_path / "bench.jsonl"
    rows = [{"problem": "What is 1 + 1?", "answer": "2", "level": "Level 1", "subject": "Algebra"},
            {"problem": "What is 2 + 3?", "answer": "5", "level": "Level 2", "subject": "Algebra"},
            {"problem": "x" * 400, "answer": "1", "level": "Level 2", "subject": "Geometry"}]
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["eval", "--model", str(tiny_gpt2), "--benchmark", str(bench), "-k", "2", "--max-new-tokens", "600",
                 "--batch-size", "2", "--device", "cpu", "--template", "paper", "--out", str(tmp_path / "ev")]) == 0
    out, err = capsys.readouterr()
    assert "eval: 2/2 prompts" in err and "left" in err
    assert "1 skipped" in out and "level" in out and "Level 2" in out and "subject" in out
    assert "new tokens capped at" in out
    summary = json.loads((tmp_path / "ev" / "bench.summary.json").read_text())
    assert summary["skipped_prompts"] == 1 and summary["n_prompts"] == 2
    assert summary["max_new_tokens"] < 512 and set(summary["breakdown"]) == {"level", "subject"}


def _fake_run(path, name, peers):
    """A node-like run folder: training rows with federation metrics, evaluations with stderr."""
    path.mkdir(parents=True)
    rows = [{"step": 0, "eval/pass@1": 0.4, "eval/stderr": 0.05}]
    for step in range(1, 6):
        row = {"step": step, "reward": 0.1 * step, "frac_all_fail": 0.5 - 0.05 * step, "graft/replaced": 2,
               "graft/admitted_frac": 0.8, "graft/s_p10": 0.5, "graft/s_p50": 0.9, "graft/s_p90": 1.1,
               "graft/s_values": [0.5, 0.9, 1.1]}
        for peer in peers:
            row[f"graft/from/{peer}/replaced"] = 1
            row[f"graft/from/{peer}/admitted_frac"] = 0.75
        rows.append(row)
    rows.append({"step": 5, "eval/pass@1": 0.45, "eval/stderr": 0.04})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_federation_panels_error_bars_and_overlays(tmp_path, capsys):
    _fake_run(tmp_path / "sim" / "a", "a", ["b", "c"])
    _fake_run(tmp_path / "sim" / "b", "b", ["a"])
    assert main(["plot", str(tmp_path / "sim" / "a")]) == 0
    out = capsys.readouterr().out.split()
    assert [Path(p).name for p in out] == ["learning_curves.png", "federation.png"]
    assert all(Path(p).stat().st_size > 10_000 for p in out)
    # a sim's folder: its node runs overlaid
    assert main(["plot", str(tmp_path / "sim")]) == 0
    out = capsys.readouterr().out.split()
    assert [Path(p).name for p in out] == ["compare_learning_curves.png", "compare_federation.png"]
    assert Path(out[0]).parent == tmp_path / "sim" / "plots"
    # explicit runs, and an error for a folder that holds none
    assert main(["plot", str(tmp_path / "sim" / "a"), str(tmp_path / "sim" / "b"), "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "compare_learning_curves.png").is_file()
    (tmp_path / "empty").mkdir()
    assert main(["plot", str(tmp_path / "empty")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err


def test_plot_draws_error_bars_on_heldout_pass1(tmp_path, monkeypatch):
    import matplotlib.axes

    from graft_fed.plotting import plot_runs

    _fake_run(tmp_path / "a", "a", ["b"])
    seen = []
    original = matplotlib.axes.Axes.errorbar

    def spy(self, x, y, yerr=None, **kw):
        seen.append((list(x), list(y), list(yerr)))
        return original(self, x, y, yerr=yerr, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", spy)
    plot_runs([tmp_path / "a"])
    assert seen == [([0, 5], [0.4, 0.45], [0.05, 0.04])]


def test_node_final_lines_keep_a_resumed_before_and_count_exchanged_steps(tmp_path, capsys):
    from types import SimpleNamespace

    from graft_fed.cli import _print_summary, exchange_line

    run = tmp_path / "node"
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "step_000000.summary.json").write_text(json.dumps({"pass@1": 0.5, "by_group": {}}))
    cfg = SimpleNamespace(run=SimpleNamespace(name="node"),
                          eval=SimpleNamespace(data=SimpleNamespace(source="embedded:arith-v1", split="test")))
    # a resumed run: its summary has no eval_before, the step-0 evaluation is on disk
    _print_summary(cfg, 4, {"output_dir": str(run), "final_checkpoint": "ck",
                            "eval_after": {"pass@1": 0.625, "stderr": 0.05, "by_group": {}}})
    assert "before 0.500 -> after 0.625" in capsys.readouterr().out
    rows = [{"step": 1, "reward": 0.1, "federation/connected": 1.0, "graft/replaced": 3},
            {"step": 2, "reward": 0.2, "federation/connected": 0.0},
            {"step": 3, "reward": 0.3, "federation/connected": 1.0, "graft/replaced": 0},
            {"step": 3, "eval/pass@1": 0.6}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert exchange_line(str(run)) == ("federation: exchanged on 1 of 3 steps (3 peer groups received); "
                                       "connected to the broker on 2")


def test_broker_start_errors_name_their_cause(tmp_path, capsys):
    """A state folder that cannot be made is not blamed on HTTP, and the HTTP port file
    names the host the live page is served on."""
    (tmp_path / "pf").write_text("a file, not a folder")
    assert main(["broker", "--set", "listen=127.0.0.1:0", "--set", "http=127.0.0.1:0",
                 "--set", f"db={tmp_path / 'pf' / 'b.sqlite'}"]) == 2
    err = capsys.readouterr().err
    assert "cannot create the folder of broker.db" in err and "--set db=PATH" in err and "HTTP" not in err


def test_the_http_port_file_names_the_http_host(tmp_path):
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    port_file = tmp_path / "http.addr"
    proc = subprocess.Popen([sys.executable, "-m", "graft_fed.cli", "broker", "--set", "listen=127.0.0.1:0",
                             "--set", "http=127.0.0.2:0", "--set", f"db={tmp_path / 'b.sqlite'}",
                             "--http-port-file", str(port_file)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        address = port_file.read_text()
        assert address.startswith("127.0.0.2:")
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=10) as r:
            assert r.read() == b"ok\n"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_a_fresh_train_into_a_used_output_dir_is_refused_and_a_refused_resume_names_the_setting(
        tiny_llama, prompt_file, tmp_path, capsys):
    cfg = _train_cfg(tmp_path, tiny_llama, prompt_file, steps=2)
    assert main(["train", "--config", str(cfg), "--quiet", "--no-eval"]) == 0
    run = tmp_path / "run"
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    # a fresh run (no --resume) into the same folder: refused before anything is written
    assert main(["train", "--config", str(cfg), "--quiet", "--no-eval", "--set", "run.steps=1"]) == 2
    err = capsys.readouterr().err
    assert str(run) in err and "step_000002" in err and "metrics.jsonl with 2 rows" in err
    assert "--resume" in err and "another run.output_dir" in err and "remove the folder" in err
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == before
    # a resume with a changed setting names it, with the checkpoint's value and this config's
    assert main(["train", "--config", str(cfg), "--quiet", "--no-eval", "--resume", "--set", "optim.lr=0.0001",
                 "--set", "run.steps=3"]) == 2
    err = capsys.readouterr().err
    assert "different configuration" in err and "optim.lr: 1e-06 -> 0.0001" in err, err
    assert "fingerprint" not in err


def test_eval_records_its_model_and_settings_and_does_not_replace_another_models(tiny_llama, tiny_gpt2, tmp_path,
                                                                                  capsys):
    out = tmp_path / "ev"
    common = ["--benchmark", "math500", "--benchmarks-dir", str(FIXTURES), "-k", "2", "--max-new-tokens", "4",
              "--device", "cpu", "--template", "paper", "--out", str(out)]
    assert main(["eval", "--model", str(tiny_llama), *common]) == 0
    summary_path = out / "math500.summary.json"
    first = json.loads(summary_path.read_text())
    assert first["model"] == str(tiny_llama) and first["benchmark"] == "math500"
    s = first["settings"]
    assert (s["k"], s["seed"], s["seeding"], s["temperature"], s["top_p"], s["max_new_tokens"], s["template"]) == \
        (2, 1234, "stream", 0.6, 0.95, 4, "paper")
    assert s["model_path"] == str(tiny_llama.resolve()) and s["split"] == "test"
    per_prompt = (out / "math500.jsonl").read_text()
    capsys.readouterr()
    # another model into the same folder: refused, nothing replaced
    assert main(["eval", "--model", str(tiny_gpt2), *common]) == 2
    err = capsys.readouterr().err
    assert str(summary_path) in err and str(tiny_llama) in err and "--out" in err and "--overwrite" in err
    assert json.loads(summary_path.read_text()) == first and (out / "math500.jsonl").read_text() == per_prompt
    # the same model with another k: refused too, naming the setting
    assert main(["eval", "--model", str(tiny_llama), *common, "-k", "1"]) == 2
    assert "k: 2 -> 1" in capsys.readouterr().err
    # the same evaluation again replaces itself; --overwrite replaces another model's
    assert main(["eval", "--model", str(tiny_llama), *common]) == 0
    capsys.readouterr()
    assert main(["eval", "--model", str(tiny_gpt2), *common, "--overwrite", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.split("\nsummary: ")[0])
    assert printed["model"] == str(tiny_gpt2) == json.loads(summary_path.read_text())["model"]
    # a summary an earlier version wrote (no settings) is not replaced silently either
    summary_path.write_text(json.dumps({"pass@1": 0.5}))
    assert main(["eval", "--model", str(tiny_gpt2), *common]) == 2
    assert "records no model or settings" in capsys.readouterr().err


def test_status_pointed_at_the_http_port_says_so(capsys):
    from graft_fed.broker.web import serve_http

    server = serve_http("127.0.0.1:0", {"/healthz": lambda: (b"ok\n", "text/plain")})
    try:
        assert main(["status", "--broker", f"127.0.0.1:{server.server_address[1]}"]) == 2
        assert "answers plain HTTP/1, not gRPC: is it the broker's HTTP port" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()


def test_status_and_a_node_over_tls_pointed_at_the_http_port_say_so(tmp_path, capsys):
    """Over TLS the HTTP port answers like a plaintext broker ("wrong version number"); the
    advice was to drop TLS ("it runs without tls_cert; drop federation.tls_*")."""
    from graft_fed.broker.web import serve_http
    from graft_fed.federation import certs
    from graft_fed.federation.certcheck import JoinTracker

    certs.init_ca(tmp_path, "fed")
    certs.issue(tmp_path, "operator")
    tls = ["--tls-ca", str(tmp_path / "ca.pem"), "--tls-cert", str(tmp_path / "operator.pem"),
           "--tls-key", str(tmp_path / "operator.key")]
    server = serve_http("127.0.0.1:0", {"/healthz": lambda: (b"ok\n", "text/plain")})
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        assert main(["status", "--broker", address, *tls]) == 2
        err = capsys.readouterr().err
        assert "answers plain HTTP/1, not gRPC: is it the broker's HTTP port" in err and "drop" not in err, err
        tracker = JoinTracker(address, "n1", tls=True, client_cert=True)
        tracker.failed(Exception("UNAVAILABLE Join: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: "
                                 "error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER"))
        assert "is it the broker's HTTP port" in str(tracker.error())
    finally:
        server.shutdown()
        server.server_close()


def test_quiet_leaves_out_the_libraries_progress_bars_too(tiny_llama, prompt_file, tmp_path, capsys):
    """transformers drew a bar for every model load and checkpoint write, under --quiet too:
    a line each in a node's log."""
    from transformers.utils import logging as hf_logging

    cfg = _train_cfg(tmp_path, tiny_llama, prompt_file, steps=1)
    try:
        assert main(["train", "--config", str(cfg), "--quiet", "--no-eval"]) == 0
        err = capsys.readouterr().err
        assert "Loading weights" not in err and "Writing model shards" not in err and "it/s" not in err, err
    finally:
        hf_logging.enable_progress_bar()


def test_status_watch_goes_on_across_a_broker_restart(tmp_path):
    """`--watch` refreshes "until Ctrl-C" (deploy.md); it exited at the first refresh a
    restarting broker did not answer. One never reached still exits (a wrong address)."""
    import signal
    import subprocess
    import sys
    import time

    from graft_fed.broker.config import load_broker_config
    from graft_fed.broker.server import BrokerServer

    def broker(listen):
        return BrokerServer(load_broker_config(None, {"listen": listen, "http": "127.0.0.1:0",
                                                      "db": str(tmp_path / "b.sqlite")})).start()

    first = broker("127.0.0.1:0")
    address = first.address
    proc = subprocess.Popen([sys.executable, "-m", "graft_fed.cli", "status", "--broker", address, "--json",
                             "--watch", "0.3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = None
    try:
        assert json.loads(proc.stdout.readline())["federation_id"]
        first.stop()
        time.sleep(2)
        assert proc.poll() is None, proc.stderr.read()
        second = broker(address)
        while True:  # refreshes resume once the broker is back
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            if line.startswith("{"):
                break
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        if second is not None:
            second.stop()
    assert "nothing listens at" in err and "trying again in 0.3 s" in err and proc.returncode == 130
    assert main(["status", "--broker", address, "--watch", "0.3"]) == 2  # never reached: exits at once


def test_a_node_stopped_by_sigterm_leaves_the_federation(tiny_llama, prompt_file, tmp_path):
    """`docker stop`, a pod's end and `systemctl stop` send SIGTERM: the node left at once only
    on Ctrl-C, and on SIGTERM simply died, so its peers waited `offline_after_s` for it."""
    import signal
    import subprocess
    import sys
    import time

    from graft_fed.configbase import to_dict
    from tests.federation.helpers import broker_config, node_config, start_broker

    broker = start_broker(broker_config(prompt_file, offline_after_s=600.0))
    try:
        cfg = node_config("a", tiny_llama, prompt_file, tmp_path, broker.address, steps=10_000)
        cfg = to_dict(cfg)
        path = tmp_path / "node.yaml"
        path.write_text(yaml.safe_dump(cfg))
        proc = subprocess.Popen([sys.executable, "-m", "graft_fed.cli", "node", "--config", str(path), "--quiet",
                                 "--no-eval"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while (node := broker.state.get_node("a")) is None or node.state != "online":
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, "the node never joined"
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 143, err
        assert "stopped by SIGTERM" in err
        assert broker.state.get_node("a").state == "left", err  # told the broker, not merely gone quiet
    finally:
        broker.stop()


def test_sigterm_handling_is_put_back_when_main_returns():
    """main() called by a program (as the suite does) leaves its SIGTERM handler as it was."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    assert main(["zoo", "list"]) == 0
    assert signal.getsignal(signal.SIGTERM) is before


def test_broker_forget_secret_releases_a_held_node_id_with_the_broker_running_or_stopped(tmp_path, capsys, prompt_file):
    """A node that lost its node_secret (or whose id another took first) is locked out of its
    id; the operator releases it. With the broker running (it holds the state's lock, so the
    command cannot open the state) the command leaves a request the broker applies within a
    second (broker/spool.py): before, the operator had to stop the broker, and the
    federation with it. With the broker stopped, the command writes the state itself."""
    from graft_fed.broker.state_sqlite import SqliteState
    from tests.federation.helpers import broker_config, start_broker

    db = tmp_path / "broker.sqlite"
    state = SqliteState(db)
    state.set_node_secret("alice", "a" * 64)
    state.set_node_secret("bob", "b" * 64)
    state.close()
    argv = ["broker", "forget-secret", "--db", str(db), "alice"]
    broker = start_broker(broker_config(prompt_file, db=str(db)))
    try:
        assert main(argv) == 0, capsys.readouterr().err
        assert "node id 'alice' is no longer held" in capsys.readouterr().out
        assert broker.state.node_secret("alice") == "" and broker.state.node_secret("bob") == "b" * 64
        assert main(argv) == 0 and "was not held" in capsys.readouterr().out
        assert sorted(p.name for p in (tmp_path / "broker.sqlite-requests").iterdir()) == []  # nothing left
    finally:
        broker.stop()
    argv = ["broker", "forget-secret", "--db", str(db), "bob"]
    assert main(argv) == 0
    assert "no longer held" in capsys.readouterr().out
    state = SqliteState(db)
    try:
        assert state.node_secret("bob") == ""
    finally:
        state.close()
    assert main(argv) == 0 and "was not held" in capsys.readouterr().out
    assert main(["broker", "forget-secret", "--db", str(tmp_path / "none.sqlite"), "alice"]) == 2
    assert "no broker state there" in capsys.readouterr().err


def test_a_node_id_is_held_for_the_secret_hash_its_node_prints(tmp_path, capsys, prompt_file, tiny_llama):
    """The operator of a node locked out of its id (its secret file lost, or the id taken
    first) prints its secret's hash; the broker's operator holds the id for that hash, with
    the broker running or stopped, so that a taker online cannot join under it again first."""
    from graft_fed.broker.state_sqlite import SqliteState
    from graft_fed.configbase import to_dict
    from graft_fed.federation.nodesecret import secret_hash
    from tests.federation.helpers import broker_config, node_config, start_broker

    cfg = node_config("a", tiny_llama, prompt_file, tmp_path, "127.0.0.1:1")
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    assert main(["node", "--config", str(path), "--print-secret-hash"]) == 0
    printed = capsys.readouterr().out.strip()
    secret = (Path(cfg.run.output_dir) / "node_secret").read_text().strip()  # made for it: the node's next run's
    assert printed == secret_hash(secret) and len(printed) == 64 and secret not in printed
    assert main(["node", "--config", str(path), "--print-secret-hash"]) == 0
    assert capsys.readouterr().out.strip() == printed  # made once

    db = tmp_path / "broker.sqlite"
    broker = start_broker(broker_config(prompt_file, db=str(db)))
    try:
        assert main(["broker", "forget-secret", "--db", str(db), "--hold-for", printed, "alice"]) == 0
        assert "held for the node whose secret hashes to" in capsys.readouterr().out
        assert broker.state.node_secret("alice") == printed
        assert main(["broker", "forget-secret", "--db", str(db), "--hold-for", "abc", "alice"]) == 2
        err = capsys.readouterr().err
        assert "--hold-for" in err and "64 hexadecimal digits" in err and "--print-secret-hash" in err, err
        assert broker.state.node_secret("alice") == printed
    finally:
        broker.stop()
    assert main(["broker", "forget-secret", "--db", str(db), "--hold-for", printed.upper(), "bob"]) == 0
    assert "held for" in capsys.readouterr().out
    state = SqliteState(db)
    try:
        assert state.node_secret("bob") == printed and state.node_secret("alice") == printed
    finally:
        state.close()


def test_forget_secret_with_the_broker_stopped_applies_first_the_requests_that_waited(tmp_path, capsys,
                                                                                     monkeypatch):
    """A request the running broker did not answer waits in its folder; the operator stops
    the broker and holds the id itself. Left there, that older request would be applied
    after the hold at the broker's next start and undo it; the command applies it first."""
    from graft_fed.broker import spool
    from graft_fed.broker.state_sqlite import SqliteState
    from graft_fed.federation.nodesecret import secret_hash

    db = tmp_path / "broker.sqlite"
    state = SqliteState(db)
    state.set_node_secret("alice", secret_hash("m" * 64))
    state.close()
    spool.Spool(db, {})  # the folder, as a broker makes it
    spool.submit(db, "forget_secret", "alice")  # not answered: the broker was stuck, then stopped
    h = secret_hash("s" * 64)
    assert main(["broker", "forget-secret", "--db", str(db), "--hold-for", h, "alice"]) == 0
    out = capsys.readouterr().out
    assert "applied first the 1 request(s) that waited" in out and "held for" in out, out
    assert not list(spool.requests_dir(db).glob("*.request"))
    answers = [json.loads(p.read_text()) for p in spool.requests_dir(db).glob("*.answer")]
    assert len(answers) == 1 and "no longer held" in answers[0]["message"], answers
    state = SqliteState(db)
    try:
        assert state.node_secret("alice") == h
    finally:
        state.close()
    # a broker of an older version answers without the options it took: --hold-for was not
    monkeypatch.setattr(spool, "broker_running", lambda db: True)
    monkeypatch.setattr(spool, "await_answer", lambda answer, wait_s: {"ok": True, "message": "no longer held"})
    assert main(["broker", "forget-secret", "--db", str(db), "--hold-for", h, "alice"]) == 2
    assert "older version, which does not take --hold-for: it released the id" in capsys.readouterr().err
    assert main(["broker", "forget-secret", "--db", str(db), "alice"]) == 0  # without it, the answer is the same


def test_broker_forget_secret_says_so_when_the_running_broker_does_not_answer(tmp_path, capsys, prompt_file,
                                                                             monkeypatch):
    """A broker that holds its state but does not take requests (stuck, or too old to have a
    requests folder): the command says what happened and where the request waits."""
    from graft_fed.broker import spool
    from tests.federation.helpers import broker_config, start_broker

    db = tmp_path / "broker.sqlite"
    broker = start_broker(broker_config(prompt_file, db=str(db)))
    try:
        monkeypatch.setattr(broker.spool, "serve", lambda now=None: 0)  # it takes none
        assert main(["broker", "forget-secret", "--db", str(db), "--wait-s", "1.5", "alice"]) == 2
        err = capsys.readouterr().err
        assert "did not answer within 1.5 s" in err and "broker.sqlite-requests" in err, err
        assert len(list(spool.requests_dir(db).glob("*.request"))) == 1
        monkeypatch.undo()  # taken at the next second: the request that waited is applied
        deadline = time.monotonic() + 10
        while list(spool.requests_dir(db).glob("*.request")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not list(spool.requests_dir(db).glob("*.request"))
        for p in spool.requests_dir(db).iterdir():
            p.unlink()
        spool.requests_dir(db).rmdir()  # a broker of a version without the folder
        assert main(["broker", "forget-secret", "--db", str(db), "alice"]) == 2
        assert "predates live requests" in capsys.readouterr().err
    finally:
        broker.stop()
