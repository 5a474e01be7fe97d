"""What the broker shows while the federation runs: the live page's data (/api/status),
per-node series for /metrics, nodes' learning-curve scalars (ReportScalars) and the
connections the broker refused.

Scalars live in memory only, bounded per node: a live view, not a record (each node's
metrics.jsonl is the record). Nothing here is a secret: no session ids, no certificates,
no trajectories, no addresses of nodes.
"""

from __future__ import annotations

import heapq
import logging
import math
import re
import threading
import time
from collections import Counter, OrderedDict
from typing import Any, Iterable, Mapping

from graft_fed.federation.errors import InvalidArgument

log = logging.getLogger("graft_fed.broker")

SCALAR_NAME = re.compile(r"^[a-z0-9_/@.]{1,64}$")
MAX_SCALARS = 16


class ScalarLog:
    """The last `keep` steps of each node's scalars; a repeated step replaces its row."""

    def __init__(self, keep: int = 2000, max_nodes: int = 256) -> None:
        self.keep, self.max_nodes = keep, max_nodes
        self._rows: dict[str, OrderedDict[int, dict[str, float]]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def validate(values: Mapping[str, float]) -> None:
        if len(values) > MAX_SCALARS:
            raise InvalidArgument(f"at most {MAX_SCALARS} scalars per step, got {len(values)}")
        for name, value in values.items():
            if not SCALAR_NAME.match(name):
                raise InvalidArgument(f"scalar name {name[:80]!r}: use 1-64 of [a-z0-9_/@.]")
            if not math.isfinite(value):
                raise InvalidArgument(f"scalar {name}: {value} is not finite")

    def record(self, node_id: str, step: int, values: Mapping[str, float]) -> None:
        self.validate(values)
        with self._lock:
            rows = self._rows.get(node_id)
            if rows is None:
                if len(self._rows) >= self.max_nodes:
                    return
                rows = self._rows[node_id] = OrderedDict()
            rows[int(step)] = {**rows.get(int(step), {}), **{k: float(v) for k, v in values.items()}}
            rows.move_to_end(int(step))
            while len(rows) > self.keep:
                rows.popitem(last=False)

    def series(self, nodes: Iterable[str] | None = None,
               max_points: int | None = None) -> dict[str, list[dict[str, float]]]:
        """Each node's rows by step; with `nodes`, those nodes' only; with `max_points`, at
        most that many values of each scalar per node, evenly spaced over the steps that have
        it, its last included (a scalar reported every 20 steps keeps its own points)."""
        if max_points is not None and max_points < 2:
            raise ValueError(f"max_points must be >= 2 (the first and the last), not {max_points}")
        with self._lock:
            wanted = self._rows if nodes is None else {n: self._rows[n] for n in nodes if n in self._rows}
            picked = {node: sorted(rows.items()) for node, rows in wanted.items()}
        out = {}
        for node, rows in picked.items():
            if max_points is None:
                out[node] = [{"step": step, **vals} for step, vals in rows]
                continue
            keep: dict[int, list[str]] = {}
            for key in sorted({k for _, vals in rows for k in vals}):
                have = [i for i, (_, vals) in enumerate(rows) if key in vals]
                if len(have) > max_points:
                    have = [have[round(j * (len(have) - 1) / (max_points - 1))] for j in range(max_points)]
                for i in have:
                    keep.setdefault(i, []).append(key)
            out[node] = [{"step": rows[i][0], **{k: rows[i][1][k] for k in keys}} for i, keys in sorted(keep.items())]
        return out

    def latest(self) -> dict[str, dict[str, float]]:
        """Per node, the latest value of each scalar (held-out pass@1 is not every step)."""
        out: dict[str, dict[str, float]] = {}
        with self._lock:
            for node, rows in self._rows.items():
                last: dict[str, float] = {}
                for step, vals in rows.items():
                    last.update(vals)
                    last["step"] = float(step)
                out[node] = last
        return out


class RefusalLog:
    """Calls the broker refused before they reached its logic (identity and allowlist), by
    reason and by the identity claimed; each refusal is logged (at most once a minute per
    reason and identity, so a node retrying in a loop does not flood the log)."""

    def __init__(self, clock=time.monotonic) -> None:
        self.by_reason: Counter[str] = Counter()
        self.by_identity: Counter[tuple[str, str]] = Counter()
        self._last_logged: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._clock = clock

    def refused(self, reason: str, identity: str, detail: str) -> None:
        # a claimed identity is client input: bounded, and escaped so it cannot forge log lines
        identity = identity[:64].encode("unicode_escape").decode("ascii") or "(none)"
        with self._lock:
            self.by_reason[reason] += 1
            if len(self.by_identity) < 1024 or (reason, identity) in self.by_identity:
                self.by_identity[(reason, identity)] += 1
            now = self._clock()
            key = (reason, identity)
            if now - self._last_logged.get(key, -math.inf) >= 60.0:
                self._last_logged[key] = now
                log.warning("refused a call from %s (%s): %s [%d so far]", identity, reason, detail,
                            self.by_identity.get(key, 0))


#: nodes the live page's matrices and curves show at most: those that gave and received the most groups
MATRIX_NODES = 64
#: points per node and learning curve on the live page (a node keeps up to 2,000 steps: 64
#: nodes' whole series made /api/status 28 MiB, fetched every 2 s by each open page)
CURVE_POINTS = 200


def _matrix(names: list[str], cells: Mapping[tuple[str, str], float]) -> list[list[float | None]]:
    return [[cells.get((src, dst)) for dst in names] for src in names]


def status_view(fed: Any, scalars: ScalarLog | None = None, refusals: RefusalLog | None = None,
                rounds: int = 50) -> dict[str, Any]:
    """The live page's data: nodes, the round timeline (the last `rounds`), the exchange and
    compatibility matrices (rows: source, columns: receiver), learning curves, refusals."""
    st = fed.status(pairs=False)
    m = st["manifest"]
    names = [n["node_id"] for n in st["nodes"]]
    view = fed.exchange()
    if len(names) > MATRIX_NODES:  # a thousand nodes would make matrices of a million cells
        moved = Counter(view.given()) + Counter(view.received())
        names = sorted(heapq.nlargest(MATRIX_NODES, sorted(names), key=lambda n: moved.get(n, 0)))
    shown = set(names)
    exchange = {key: float(g) for key, g in view.among(shown).items()}
    rows = fed.compat(among=shown)
    compat = {(c.source, c.receiver): c.mean_s for c in rows if not math.isnan(c.mean_s)}
    admitted = {(c.source, c.receiver): c.admitted_fraction for c in rows if not math.isnan(c.admitted_fraction)}
    timeline = []
    now = fed.clock()
    current = st["current_round"]
    for r in range(max(0, current - rounds + 1), current + 1):
        row = fed.state.get_round(r)
        if row is None:
            continue
        timeline.append({"round": r, "state": row.state, "opened_s_ago": now - row.opened_at,
                         "matching_s": (row.matched_at - row.opened_at) if row.matched_at else None,
                         "participants": list(row.participants)})
    latest = scalars.latest() if scalars is not None else {}
    nodes = [{**n, "latest": latest.get(n["node_id"], {})} for n in st["nodes"]]
    return {
        "federation": {"federation_id": m.federation_id, "dataset_id": m.dataset_id, "n": m.n,
                       "prompts_per_round": m.prompts_per_round, "mode": str(m.mode),
                       "protocol_version": m.protocol_version, "max_node_summaries": st["max_node_summaries"],
                       "max_node_bundle_bytes": st["max_node_bundle_bytes"]},
        "current_round": current, "bundles": st["bundles"], "bundle_bytes": st["bundle_bytes"],
        "nodes": nodes, "rounds": timeline,
        "matrix": {"names": names, "nodes_total": len(st["nodes"]), "exchange": _matrix(names, exchange),
                   "compat": _matrix(names, compat), "admitted": _matrix(names, admitted)},
        "curves": scalars.series(names, CURVE_POINTS) if scalars is not None else {},
        "refused": dict(refusals.by_reason) if refusals is not None else {},
        "time": time.time(),
    }


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def node_metrics(fed: Any, scalars: ScalarLog | None, refusals: RefusalLog | None,
                 st: dict | None = None) -> list[str]:
    """Prometheus lines: per-node series and refusals (appended to the broker's /metrics).
    `st`: the broker's status without pairs, when the caller has it already. The
    source -> receiver series are there while at most `max_pairs_shown` pairs exchanged
    (N^2 series in all: a thousand nodes would make a million); beyond, `pair_series_omitted`
    says so and the pairs are on the live page and the Status RPC."""
    st = fed.status(pairs=False) if st is None else st
    exchange = fed.exchange()
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP graft_fed_{name} {help_}")
        lines.append(f"# TYPE graft_fed_{name} {kind}")
        lines.extend(f"graft_fed_{name}{labels} {value}" for labels, value in samples)

    nodes = st["nodes"]
    metric("node_up", "gauge", "1 when the node is online (state label: its lifecycle state).",
           [(f'{{node="{_esc(n["node_id"])}",state="{n["state"]}"}}', 1.0 if n["state"] == "online" else 0.0)
            for n in nodes])
    metric("node_round", "gauge", "The node's last reported round.",
           [(f'{{node="{_esc(n["node_id"])}"}}', n["round"]) for n in nodes])
    metric("node_published_total", "counter", "Group summaries the node published.",
           [(f'{{node="{_esc(n["node_id"])}"}}', n["published"]) for n in nodes])
    metric("node_last_seen_seconds", "gauge", "Seconds since the node's last call.",
           [(f'{{node="{_esc(n["node_id"])}"}}', round(n["last_seen_s"], 3)) for n in nodes])
    # the per-node quotas and what each node holds against them: an alert on held / quota
    # warns an operator before a node's publishes or uploads are refused
    metric("node_summaries_held", "gauge", "The node's summaries the broker holds (what "
           "broker.max_node_summaries counts; retention lowers it).",
           [(f'{{node="{_esc(n["node_id"])}"}}', n["summaries_held"]) for n in nodes])
    metric("node_bundle_bytes_held", "gauge", "Bytes of the bundles the node uploaded that the broker holds "
           "(what broker.max_node_bundle_mib counts).",
           [(f'{{node="{_esc(n["node_id"])}"}}', n["bundle_bytes_held"]) for n in nodes])
    metric("max_node_summaries", "gauge", "The per-node quota of summaries held (0: off).",
           [("", st["max_node_summaries"])])
    metric("max_node_bundle_bytes", "gauge", "The per-node quota of bundle bytes held (0: off).",
           [("", st["max_node_bundle_bytes"])])
    received, given = exchange.received(), exchange.given()
    metric("node_groups_received_total", "counter", "Groups matched to the node from peers.",
           [(f'{{node="{_esc(n["node_id"])}"}}', received.get(n["node_id"], 0)) for n in nodes])
    metric("node_groups_given_total", "counter", "The node's groups matched to peers.",
           [(f'{{node="{_esc(n["node_id"])}"}}', given.get(n["node_id"], 0)) for n in nodes])
    metric("pairs", "gauge", "(source, receiver) pairs that exchanged at least one group.", [("", len(exchange))])
    omitted = len(exchange) > fed.cfg.max_pairs_shown
    metric("pair_series_omitted", "gauge", "1 when the pairs outnumber broker.max_pairs_shown and "
           "pair_groups_total is left out (the live page and the Status RPC have them).", [("", int(omitted))])
    if not omitted:
        metric("pair_groups_total", "counter", "Groups matched source -> receiver.",
               [(f'{{source="{_esc(src)}",receiver="{_esc(dst)}"}}', groups)
                for (src, dst), groups in exchange.items()])
    # the receivers' reports: in all, and per pair while the pairs are few enough to list
    # (the table is copied only then; retention never drops its pairs, so they can
    # outnumber the pairs that exchanged: they have a gauge of their own)
    reported_pairs, _, undelivered = fed.compat_totals()
    metric("undelivered_groups_total", "counter", "Groups receivers reported never received (their source did not "
           "upload them in time, or the fetch failed): they weigh in the pair's mean s but not in the quarantine "
           "rate (each group counted once, as rejected_groups_total).", [("", undelivered)])
    metric("reported_pairs", "gauge", "(source, receiver) pairs the receiver reported on (never pruned).",
           [("", reported_pairs)])
    omitted = reported_pairs > fed.cfg.max_pairs_shown
    metric("pair_report_series_omitted", "gauge", "1 when the reported pairs outnumber broker.max_pairs_shown and "
           "pair_reported_total, pair_rejected_total and pair_undelivered_total are left out (the Status RPC "
           "lists the pairs with the most groups).", [("", int(omitted))])
    if not omitted:
        compat = fed.compat_view()
        names = compat.names
        pairs = sorted((names[s], names[r], i) for i, (s, r) in enumerate(zip(compat.source.tolist(),
                                                                            compat.receiver.tolist())))
        labels = [f'{{source="{_esc(src)}",receiver="{_esc(dst)}"}}' for src, dst, _ in pairs]
        order = [i for _, _, i in pairs]
        for name, values, help_ in (("pair_reported_total", compat.reported,
                                     "Groups the receiver reported on (rejected included)"),
                                    ("pair_rejected_total", compat.rejected, "Groups the receiver rejected"),
                                    ("pair_undelivered_total", compat.undelivered,
                                     "Groups the receiver reported never received")):
            metric(name, "counter", f"{help_}, source -> receiver; left out past broker.max_pairs_shown.",
                   list(zip(labels, values[order].tolist())))
    if scalars is not None:
        samples = []
        for node, vals in sorted(scalars.latest().items()):
            for key, value in sorted(vals.items()):
                if key != "step":
                    samples.append((f'{{node="{_esc(node)}",name="{key}"}}', value))
        metric("node_scalar", "gauge", "The latest learning-curve scalar a node reported (ReportScalars).", samples)
    if refusals is not None:
        metric("refused_total", "counter", "Calls refused by identity or allowlist checks, by reason.",
               [(f'{{reason="{r}"}}', v) for r, v in sorted(refusals.by_reason.items())])
        metric("refused_by_identity_total", "counter", "Refused calls by reason and the identity claimed.",
               [(f'{{reason="{r}",identity="{_esc(i)}"}}', v) for (r, i), v in sorted(refusals.by_identity.items())])
    return lines
