"""One-machine federation: a broker and N node processes talking gRPC over loopback.

`graft-fed sim --nodes 3 --config configs/sim-zoo.yaml` writes one config per process
under the output folder, starts `graft-fed broker` and `graft-fed node` as separate
processes (one GPU each where GPUs exist, CPU threads split otherwise), shows per-node
progress from their metrics files, and ends with a table: accuracy before and after,
groups received from and given to each peer, admitted fraction.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from graft_fed.configbase import deep_merge, load_config, require
from graft_fed.errors import ConfigError, GraftFedError
from graft_fed.trainer.config import member_seed


@dataclass(frozen=True)
class SimNode:
    """One node of the simulated federation: a name, a model and its own overrides."""

    #: Node name (node id, run name, output sub-folder).
    name: str = ""
    #: The node's model section (path, template).
    model: Mapping[str, Any] = field(default_factory=dict)
    #: Extra overrides of this node's run config (e.g. optim).
    overrides: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SimConfig:
    """A federation on one machine."""

    #: Where the broker database, per-process configs, logs and node runs go.
    output_dir: str = "runs/sim"
    #: Broker settings (a broker config; listen/http/db are chosen by the simulator).
    broker: Mapping[str, Any] = field(default_factory=dict)
    #: The run config shared by every node (model, output_dir and federation set per node).
    base: Mapping[str, Any] = field(default_factory=dict)
    #: The nodes; `--nodes N` takes the first N.
    nodes: tuple[SimNode, ...] = ()
    #: Seconds to wait for the whole federation before giving up.
    timeout_s: float = 3600.0
    #: When a node process exits with an error: "stop" the federation (default) or "continue"
    #: without it (the sim says so, and that rounds wait out round_deadline_s if the broker's
    #: min_nodes can no longer be met). Either way the cause is shown from the node's log.
    on_node_exit: str = "stop"

    def __post_init__(self) -> None:
        require(self.on_node_exit in ("stop", "continue"),
                f"sim.on_node_exit must be stop or continue, got {self.on_node_exit!r}")
        require(len(self.nodes) >= 1, "sim.nodes must list at least one node")
        names = [n.name for n in self.nodes]
        require(all(names) and len(set(names)) == len(names), f"sim node names must be unique, got {names}")


def load_sim_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> SimConfig:
    """The sim config at `path` with dotted `overrides` (`--set broker.min_nodes=2`,
    `--set base.run.steps=5`) applied."""
    return load_config(SimConfig, path, overrides, "sim config")


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch CUDA means CPU
        return 0


def exit_reason(log: Path, max_lines: int = 400) -> str:
    """Why a process ended, from its log: its `graft-fed CMD: error: ...` line, else the last
    line of a traceback, else the last line it wrote."""
    try:
        lines = [x.rstrip() for x in log.read_text(encoding="utf-8", errors="replace").splitlines()[-max_lines:]]
    except OSError:
        return f"(no log at {log})"
    lines = [x for x in lines if x.strip()]
    for line in reversed(lines):
        if line.startswith("graft-fed ") and ": error: " in line:
            return line.split(": error: ", 1)[1]
    if any(x.startswith("Traceback") for x in lines):
        for line in reversed(lines):
            if not line.startswith((" ", "\t")) and not line.startswith("Traceback"):
                return line
    return lines[-1] if lines else "(the log is empty)"


def _holds_nodes(db: Path) -> bool:
    """Whether a broker state holds a node (a sim whose broker was refused at start, or whose
    nodes all failed before joining, leaves an empty one: nothing to continue)."""
    import sqlite3

    if not db.is_file() or db.stat().st_size == 0:
        return False
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            return conn.execute("SELECT 1 FROM nodes LIMIT 1").fetchone() is not None
        finally:
            conn.close()
    except sqlite3.Error:
        return True  # unreadable: not ours to judge or to overwrite


class Simulation:
    def __init__(self, cfg: SimConfig, n_nodes: int, quiet: bool = False) -> None:
        if not 1 <= n_nodes <= len(cfg.nodes):
            raise ConfigError(f"--nodes {n_nodes}: the config lists {len(cfg.nodes)} nodes")
        self.cfg = cfg
        self.nodes = cfg.nodes[:n_nodes]
        self.root = Path(cfg.output_dir)
        self.quiet = quiet
        self.procs: dict[str, subprocess.Popen] = {}
        #: nodes that exited with an error: name -> (exit code, reason from its log)
        self.failed: dict[str, tuple[int, str]] = {}
        #: the broker's live page (set once the broker listens)
        self.live_url: str | None = None
        #: the broker's min_nodes as it runs: the config's, at most the nodes this sim runs
        #: (otherwise every round would wait out round_deadline_s for nodes that never come)
        wanted = cfg.broker.get("min_nodes", 1)
        valid = isinstance(wanted, int) and not isinstance(wanted, bool)  # else the broker refuses the config
        self.min_nodes = min(wanted, len(self.nodes)) if valid else 1
        self._lowered_from = wanted if valid and wanted > self.min_nodes else None

    def _cli(self) -> list[str]:
        return [sys.executable, "-m", "graft_fed.cli"]

    def _write(self, name: str, data: Mapping[str, Any]) -> Path:
        path = self.root / "configs" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(json.loads(json.dumps(data)), sort_keys=False), encoding="utf-8")
        return path

    def start_broker(self) -> str:
        port_file = self.root / "broker.port"
        port_file.unlink(missing_ok=True)
        bcfg = deep_merge(self.cfg.broker, {"listen": "127.0.0.1:0", "http": "127.0.0.1:0",
                                              "db": str(self.root / "broker.sqlite")})
        if self._lowered_from is not None:
            bcfg["min_nodes"] = self.min_nodes
            if not self.quiet:
                print(f"broker.min_nodes {self._lowered_from} -> {self.min_nodes}: this sim runs "
                      f"{len(self.nodes)} node(s)", flush=True)
        path = self._write("broker", bcfg)
        log = (self.root / "logs").joinpath("broker.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        http_file = self.root / "broker.http"
        http_file.unlink(missing_ok=True)
        self.procs["broker"] = subprocess.Popen(self._cli() + ["broker", "--config", str(path), "--port-file",
                                                               str(port_file), "--http-port-file", str(http_file)],
                                                stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not port_file.is_file():
            if self.procs["broker"].poll() is not None:
                raise GraftFedError(f"the broker exited at start (code {self.procs['broker'].returncode}): "
                                    f"{exit_reason(log)}; see {log}")
            if time.monotonic() > deadline:
                raise GraftFedError(f"the broker did not start within 120 s; see {log}")
            time.sleep(0.1)
        while not http_file.is_file() and self.procs["broker"].poll() is None:
            time.sleep(0.05)  # written right after the gRPC port file
        http = http_file.read_text().strip() if http_file.is_file() else ""
        self.live_url = f"http://{http}/" if http else None
        return port_file.read_text().strip()

    def start_nodes(self, address: str) -> None:
        gpus = _gpus()
        threads = max(1, (os.cpu_count() or 1) // len(self.nodes))
        base_run = dict(self.cfg.base.get("run") or {})
        seed = int(base_run.get("seed", 0))
        for i, node in enumerate(self.nodes):
            # Each node samples with its own seed, as independently trained models do; all share
            # the prompt schedule's seed (the broker's).
            run = {"name": node.name, "output_dir": str(self.root / node.name), "seed": member_seed(seed, node.name),
                   "schedule_seed": base_run.get("schedule_seed", seed)}
            env = dict(os.environ)
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = str(i % gpus)
            else:
                run["threads"] = threads
                run["device"] = "cpu"
            data = deep_merge(self.cfg.base, {"run": run, "model": dict(node.model),
                                               "federation": {"broker": address, "node_id": node.name}})
            data = deep_merge(data, node.overrides)
            path = self._write(node.name, data)
            log = (self.root / "logs").joinpath(f"{node.name}.log")
            self.procs[node.name] = subprocess.Popen(self._cli() + ["node", "--config", str(path), "--quiet"],
                                                     stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)

    def _progress(self) -> str:
        parts = []
        for node in self.nodes:
            path = self.root / node.name / "metrics.jsonl"
            last: dict[str, Any] = {}
            if path.is_file():
                for line in path.read_text(encoding="utf-8").splitlines():
                    row = json.loads(line)
                    if "reward" in row:
                        last = row
            code = self.procs[node.name].poll() if node.name in self.procs else None
            if code not in (None, 0):
                parts.append(f"{node.name}: EXITED {code}")
            elif last:
                parts.append(f"{node.name}: step {last['step']} reward {last['reward']:.2f} "
                             f"recv {last.get('graft/replaced', 0):.0f}" + (" done" if code == 0 else ""))
            else:
                parts.append(f"{node.name}: " + ("done" if code == 0 else "starting"))
        return " | ".join(parts)

    def _node_exited(self, name: str, code: int) -> None:
        log = self.root / "logs" / f"{name}.log"
        reason = exit_reason(log)
        self.failed[name] = (code, reason)
        if self.cfg.on_node_exit == "stop":
            raise GraftFedError(f"node {name} exited with code {code}: {reason} (log: {log}); stopping the "
                                "federation (sim config `on_node_exit: continue` goes on without it)")
        running = [n.name for n in self.nodes if self.procs[n.name].poll() is None]
        quorum = self.min_nodes
        note = ""
        if quorum > len(running):
            note = (f"; the broker's min_nodes={quorum} can no longer be met, so every round now waits its "
                    f"round_deadline_s ({self.cfg.broker.get('round_deadline_s', 'default')} s)")
        print(f"sim: node {name} exited with code {code}: {reason} (log: {log}); continuing with "
              f"{', '.join(running) or 'no nodes'}{note}", file=sys.stderr, flush=True)

    def wait(self) -> None:
        deadline = time.monotonic() + self.cfg.timeout_s
        shown = ""
        while True:
            codes = {n.name: self.procs[n.name].poll() for n in self.nodes}
            for name, code in codes.items():
                if code not in (None, 0) and name not in self.failed:
                    self._node_exited(name, code)
            if all(c is not None for c in codes.values()):
                break
            if self.procs["broker"].poll() is not None:
                log = self.root / "logs" / "broker.log"
                raise GraftFedError(f"the broker exited with code {self.procs['broker'].returncode}: "
                                    f"{exit_reason(log)} (log: {log})")
            if time.monotonic() > deadline:
                raise GraftFedError(f"the federation did not finish within {self.cfg.timeout_s} s: {self._progress()}")
            line = self._progress()
            if line != shown and not self.quiet:
                print(line, flush=True)
                shown = line
            time.sleep(1.0)

    def stop(self) -> None:
        # the nodes first: a node stopped by SIGTERM leaves the federation, which needs the broker
        nodes = [proc for name, proc in self.procs.items() if name != "broker"]
        for group in (nodes, [self.procs["broker"]] if "broker" in self.procs else []):
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in group:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()

    def earlier_run(self) -> list[str]:
        """What an earlier sim left in the output folder: its broker state and node runs. A
        new sim there would join the earlier federation at its last round and mix its results
        (and the result table) with the earlier ones."""
        found = [p.name for p in (self.root / "broker.sqlite",) if _holds_nodes(p)]
        found += [f"{n.name}/" for n in self.cfg.nodes if (self.root / n.name / "metrics.jsonl").exists()]
        return found

    def run(self) -> str:
        found = self.earlier_run()
        if found:
            raise GraftFedError(f"{self.root} holds an earlier sim ({', '.join(found)}): a new one there would "
                                "continue its federation and mix the results. Choose another folder with "
                                f"--output-dir, or move {self.root} away (or delete it) to start again")
        try:
            address = self.start_broker()
            if not self.quiet:
                print(f"broker on {address}; starting {len(self.nodes)} nodes: "
                      + ", ".join(n.name for n in self.nodes)
                      + (f"; live page: {self.live_url}" if self.live_url else ""), flush=True)
            self.start_nodes(address)
            self.wait()
        finally:
            self.stop()
        table = result_table(self.root, [n.name for n in self.nodes], failed=self.failed)
        (self.root / "result.md").write_text(table, encoding="utf-8")
        return table


def eval_before(run_dir: Path, summary: Mapping[str, Any]) -> dict[str, Any]:
    """A run's held-out evaluation before training: in its summary, or (a resumed run, whose
    summary covers the resumed part only) in the step-0 evaluation file it wrote at the start."""
    if summary.get("eval_before"):
        return dict(summary["eval_before"])
    path = run_dir / "eval" / "step_000000.summary.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def result_table(root: Path, names: list[str], failed: Mapping[str, tuple[int, str]] | None = None) -> str:
    failed = dict(failed or {})
    rows = []
    received: dict[tuple[str, str], float] = {}
    admitted: dict[str, tuple[float, float]] = {}
    for name in names:
        summary_path = root / name / "summary.json"
        summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else {}
        before = eval_before(root / name, summary).get("pass@1", math.nan)
        after = summary.get("eval_after", {}).get("pass@1", math.nan)
        peer_resp = adm = 0.0
        metrics = root / name / "metrics.jsonl"
        for line in (metrics.read_text(encoding="utf-8").splitlines() if metrics.is_file() else []):
            row = json.loads(line)
            for other in names:
                received[(other, name)] = received.get((other, name), 0.0) + (row.get(f"graft/from/{other}/replaced")
                                                                              or 0.0)
            n_peer = row.get("graft/peer_responses") or 0.0
            frac = row.get("graft/admitted_frac")
            if n_peer and frac is not None:
                peer_resp += n_peer
                adm += frac * n_peer
        admitted[name] = (adm, peer_resp)
        if name not in failed:
            rows.append((name, before, after))
    lines = ["| node | pass@1 before | pass@1 after | Δ | " + " | ".join(f"from {o}" for o in names)
             + " | given | admitted |", "|" + "---|" * (6 + len(names))]
    for name, before, after in rows:
        given = sum(v for (src, dst), v in received.items() if src == name and dst != name)
        adm, tot = admitted[name]
        lines.append(f"| {name} | {100 * before:.1f} | {100 * after:.1f} | {100 * (after - before):+.1f} | "
                     + " | ".join("-" if o == name else f"{received.get((o, name), 0):.0f}" for o in names)
                     + f" | {given:.0f} | {(adm / tot if tot else math.nan):.2f} |")
    for name, (code, reason) in failed.items():
        lines.append(f"| {name} | exited with code {code}: {reason.replace('|', '/')} |" + " |" * (4 + len(names)))
    lines.append("")
    lines.append("pass@1: held-out test split (eval section). from X: groups received from X (replaced "
                 "all-fail groups); given: groups this node's trajectories replaced at peers; admitted: share "
                 "of received peer responses with s > delta.")
    return "\n".join(lines) + "\n"
