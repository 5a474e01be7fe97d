"""`graft-fed <command>`: the one entry point."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import Sequence

from graft_fed.configbase import parse_overrides
from graft_fed.errors import GraftFedError


def cmd_train(args: argparse.Namespace) -> int:
    from graft_fed.trainer.config import load_train_config
    from graft_fed.graft import stored
    from graft_fed.trainer.distributed import make_trainer, shutdown

    overrides = parse_overrides(args.set)
    if args.peer_store:
        overrides["graft.peer_store"] = args.peer_store
    if args.peer_run:
        overrides["graft.peer_run"] = args.peer_run
    cfg = load_train_config(args.config, overrides)
    try:
        # under torchrun: one process of an FSDP2 run (graft_fed/trainer/distributed.py)
        with make_trainer(cfg, resume=args.resume, quiet=args.quiet) as trainer:
            summary = stored.train(trainer, evaluate_before_after=not args.no_eval)
    finally:
        shutdown()
    if trainer.is_main:
        _print_summary(cfg, trainer.step, summary)
    return 0


def _print_summary(cfg, steps: int, summary: dict) -> None:
    if not summary.get("eval_before") and summary.get("output_dir"):
        # a resumed run: its step-0 evaluation is on disk from the first start
        from pathlib import Path

        from graft_fed.sim import eval_before

        found = eval_before(Path(summary["output_dir"]), summary)
        if found:
            summary = {**summary, "eval_before": found}
    before = summary.get("eval_before", {}).get("pass@1")
    after = summary.get("eval_after", {}).get("pass@1")
    print(f"run {cfg.run.name}: {steps} steps, checkpoint {summary['final_checkpoint']}")
    if after is not None:
        b = f"{before:.3f}" if before is not None else "n/a (resumed)"
        print(f"held-out pass@1 ({cfg.eval.data.source}:{cfg.eval.data.split}): before {b} -> after {after:.3f} "
              f"(+- {summary['eval_after']['stderr']:.3f})")
        for fam, v in summary["eval_after"].get("by_group", {}).items():
            bv = summary.get("eval_before", {}).get("by_group", {}).get(fam)
            print(f"  {fam:>6}: " + (f"{bv:.3f} -> " if bv is not None else "") + f"{v:.3f}")


def cmd_cotrain(args: argparse.Namespace) -> int:
    from graft_fed.graft.cotrain import CoTrainer, load_cotrain_config
    from graft_fed.trainer.distributed import shutdown

    cfg = load_cotrain_config(args.config, parse_overrides(args.set))
    try:
        with CoTrainer(cfg, resume=args.resume, quiet=args.quiet) as co:
            summaries = co.train(evaluate_before_after=not args.no_eval)
            for i, summary in enumerate(summaries):
                if co.trainers[i].is_main:
                    _print_summary(cfg.member_config(i), co.step, summary)
    finally:
        shutdown()
    return 0


def cmd_experiment(args: argparse.Namespace) -> int:
    from graft_fed.experiment import Experiment, load_experiment_config, write_report

    import dataclasses

    cfg = load_experiment_config(args.config, quick=args.quick)
    if args.output_dir:
        cfg = dataclasses.replace(cfg, output_dir=args.output_dir)
    # a subset (e.g. one seed per process, or one pair when time is short); the report still
    # covers every seed, pair and arm of the config that has finished runs
    run_cfg = cfg
    if args.seeds:
        run_cfg = dataclasses.replace(run_cfg, seeds=tuple(args.seeds))
    if args.pairs:
        pairs = tuple(tuple(p.split("+")) for p in args.pairs)
        unknown = [p for p in pairs if p not in cfg.pairs]
        if unknown:
            raise GraftFedError(f"--pairs {unknown} are not pairs of {args.config}: {list(cfg.pairs)}")
        run_cfg = dataclasses.replace(run_cfg, pairs=pairs)
    if args.arms:
        unknown = [a for a in args.arms if a not in cfg.arms]
        if unknown:
            raise GraftFedError(f"--arms {unknown} are not arms of {args.config}: {list(cfg.arms)}")
        wanted = set(args.arms) | ({"grpo_n8"} if "stored" in args.arms else set())  # stored learns from them
        run_cfg = dataclasses.replace(run_cfg, arms=tuple(a for a in cfg.arms if a in wanted))
    if args.reevaluate:
        n = Experiment(run_cfg, quiet=args.quiet).reevaluate()
        print(f"re-evaluated {n} finished run(s) with the config's eval section", file=sys.stderr)
    elif not args.report_only:
        Experiment(run_cfg, quiet=args.quiet).run()
    report = write_report(cfg)
    print(report.read_text(encoding="utf-8"))
    print(f"report: {report}")
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    from graft_fed.federation import certs

    days = getattr(args, "days", None)
    if days is not None and days < 1:
        raise GraftFedError(f"--days {days}: a certificate must be valid for at least one day")
    if args.certs_command == "init":
        print(f"CA: {certs.init_ca(args.dir, args.federation, args.days)}")
    elif args.certs_command == "issue":
        hosts = [h for h in (args.hosts or "").split(",") if h]
        cert, key = certs.issue(args.dir, args.name, hosts, args.days)
        print(f"certificate {cert}\nkey         {key}")
    else:
        entry = certs.revoke(args.dir, args.name)
        print(f"revoked {entry['name']} (serial {entry['serial']}); also run `graft-fed broker nodes revoke "
              f"--allowlist FILE {entry['name']}` so the broker refuses it at once")
    return 0


def cmd_broker_nodes(args: argparse.Namespace) -> int:
    from graft_fed.broker.auth import Allowlist

    from pathlib import Path

    folder = Path(args.allowlist).parent
    if args.nodes_command != "list" and not folder.is_dir():
        raise GraftFedError(f"--allowlist {args.allowlist}: the folder {folder} does not exist; create it first "
                            "(the broker reads the allowlist from the path in its config)")
    if args.nodes_command == "list" and not Path(args.allowlist).is_file():
        raise GraftFedError(f"--allowlist {args.allowlist} does not exist; `broker nodes add` creates it")
    out = Allowlist.edit(args.allowlist, args.nodes_command, getattr(args, "name", None))
    for name in out["allowed"]:
        print(f"allowed  {name}")
    for name in out["revoked"]:
        print(f"revoked  {name}")
    for name in out["trusted"]:
        print(f"trusted  {name} (exempt from quarantine)")
    return 0


def _reexec_without_tcache() -> None:
    """Run this command again in this process (same pid, same arguments) with glibc's
    per-thread caches off (`broker.malloc_tcache: false`, broker/heap.py): glibc reads that
    only from the environment at start. Only where the process is the command itself (a
    program that calls main() keeps its process); nothing happens off glibc or where
    GLIBC_TUNABLES already sets tcache_count (as it does in the re-executed process)."""
    from graft_fed.broker.heap import without_tcache

    env = without_tcache(os.environ)
    argv = getattr(sys, "orig_argv", None)
    if env is None or not argv or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *argv[1:]], env)
    except OSError as exc:  # the broker still runs, with glibc's caches on
        logging.getLogger("graft_fed.broker").warning(
            "could not restart with glibc's per-thread caches off (%s): serving with them on", exc)


def cmd_broker_forget_secret(args: argparse.Namespace) -> int:
    """Drop the hash of the secret that holds a node id (broker/sessions.py, Join), or hold
    the id for another node's secret (`--hold-for`), and end the id's session. With the
    broker stopped, in its state; with it running (it holds the state's lock), as a request
    the broker applies within a second (broker/spool.py)."""
    from pathlib import Path

    from graft_fed.broker import spool
    from graft_fed.broker.sessions import forget_secret, hold_for_of
    from graft_fed.broker.state_sqlite import SqliteState
    from graft_fed.federation.nodesecret import parse_secret_hash

    try:
        hold_for = parse_secret_hash(args.hold_for) if args.hold_for is not None else ""
    except ValueError as exc:
        raise GraftFedError(f"--hold-for: {exc}") from None
    if not Path(args.db).is_file():
        raise GraftFedError(f"--db {args.db}: no broker state there (the broker config's `db`)")
    if spool.broker_running(args.db):
        options = {"hold_for": hold_for} if hold_for else {}
        answer = spool.await_answer(spool.submit(args.db, "forget_secret", args.node_id, options), args.wait_s)
        if answer is None:
            raise GraftFedError(f"the broker of {args.db} runs (it holds the state) but did not answer within "
                                f"{args.wait_s:g} s (it takes requests each second): the request waits in "
                                f"{spool.requests_dir(args.db)} and is applied when it does, after those left "
                                "before it; its log says so")
        print(answer.get("message", ""))
        if answer.get("ok") and not set(options) <= set(answer.get("options") or ()):
            raise GraftFedError("the running broker is of an older version, which does not take --hold-for: it "
                                "released the id instead (the next Join under it that carries a node secret holds "
                                "it). Restart the broker on this version, then run the command again")
        return 0 if answer.get("ok") else 1
    state = SqliteState(args.db)
    try:
        waiting = sorted(spool.requests_dir(args.db).glob("*.request"))
        if waiting:  # left for a broker that did not take them: applied first, as it would have
            try:
                served = spool.Spool(args.db, {"forget_secret": lambda node_id, options: forget_secret(
                    state, node_id, hold_for_of(options))[0]}).serve()
            except (OSError, GraftFedError) as exc:
                raise GraftFedError(f"{len(waiting)} request(s) left for the broker wait in "
                                    f"{spool.requests_dir(args.db)}, and this user cannot apply them ({exc}); the "
                                    "broker would apply them after this command at its next start. Run the command "
                                    "as the broker's user, or delete them") from None
            print(f"applied first the {served} request(s) that waited for the broker in {spool.requests_dir(args.db)}, "
                  "in the order they were left")
        print(forget_secret(state, args.node_id, hold_for)[0])
    finally:
        state.close()
    return 0


def cmd_broker(args: argparse.Namespace) -> int:
    if getattr(args, "nodes_command", None):
        return cmd_broker_nodes(args)
    if getattr(args, "forget_secret", False):
        return cmd_broker_forget_secret(args)
    import threading

    from graft_fed.broker.config import load_broker_config
    from graft_fed.broker.server import start_broker

    cfg = load_broker_config(args.config, parse_overrides(args.set))
    if not cfg.malloc_tcache and args.as_command:
        _reexec_without_tcache()
    try:
        server = start_broker(cfg)  # heap, then serving, then the collector (broker/server.py)
    except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
        raise GraftFedError(f"cannot listen for gRPC on {cfg.listen}: the address is taken or not this machine's "
                            f"({str(exc).split(';')[0]}); is another broker running? choose another with "
                            "--set listen=HOST:PORT") from None
    except OSError as exc:  # what the state's own checks did not name (its errors say what to do)
        raise GraftFedError(f"cannot start the broker: {exc.strerror or exc}"
                            + (f" ({exc.filename})" if exc.filename else "")) from None
    from pathlib import Path

    http_host = cfg.http.rpartition(":")[0]
    for path, value in ((args.port_file, server.address),
                        (args.http_port_file, f"{http_host}:{server.http_port}" if server.http_port else "")):
        if path:
            tmp = Path(path + ".tmp")
            tmp.write_text(value)
            tmp.replace(path)
    print(f"broker listening on {server.address}" + (f", http on {server.http_port}" if server.http_port else ""),
          flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0) and not server.failed.is_set():
        pass
    server.stop()
    if server.failed.is_set():
        raise GraftFedError(f"{server.failure}; restart it (nothing acknowledged was lost)")
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    from graft_fed.node.node import Node, load_node_config
    from graft_fed.trainer.distributed import shutdown

    cfg = load_node_config(args.config, parse_overrides(args.set))
    if args.print_secret_hash:
        from graft_fed.federation.nodesecret import secret_hash
        from graft_fed.node.secret import load_or_create

        print(secret_hash(load_or_create(cfg.run.output_dir)))
        return 0
    if args.join_timeout < 0:
        raise GraftFedError(f"--join-timeout {args.join_timeout}: give seconds >= 0 (0: do not wait)")
    try:
        # under torchrun: one node sharded over the processes; the main one talks to the broker
        with Node(cfg, resume=args.resume, quiet=args.quiet) as node:
            node.connect(args.join_timeout)
            summary = node.train(evaluate_before_after=not args.no_eval)
    finally:
        shutdown()
    if node.trainer.is_main:
        _print_summary(cfg, node.trainer.step, summary)
        print(exchange_line(cfg.run.output_dir))
    return 0


def exchange_line(run_dir: str) -> str:
    """How much a node took part, from its metrics: steps connected to the broker, steps on
    which it received peer groups, and how many."""
    from pathlib import Path

    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "reward" in row:
                rows.append(row)
    connected = sum(1 for r in rows if r.get("federation/connected") == 1.0)
    exchanged = sum(1 for r in rows if (r.get("graft/replaced") or 0) > 0)
    groups = sum(r.get("graft/replaced") or 0 for r in rows)
    return (f"federation: exchanged on {exchanged} of {len(rows)} steps ({groups:.0f} peer groups received); "
            f"connected to the broker on {connected}")


def _status_dict(st) -> dict:
    from graft_fed.federation.codec import manifest_from_pb

    m = st.manifest

    def given(msg, name: str) -> int | None:  # None where a broker older than the field left it out
        return getattr(msg, name) if msg.HasField(name) else None

    return {"federation_id": m.federation_id, "dataset_id": m.dataset_id, "n": m.n,
            "prompts_per_round": m.prompts_per_round,
            # the whole manifest: what a node must match to join (a refused node's operator compares these)
            "manifest": manifest_from_pb(m).to_dict(),
            "current_round": st.current_round, "bundles": st.bundles,
            "bundle_bytes": st.bundle_bytes,
            # the per-node quotas (0: off)
            "max_node_summaries": given(st, "max_node_summaries"),
            "max_node_bundle_bytes": given(st, "max_node_bundle_bytes"),
            "nodes": [{"node_id": n.node_id, "model_id": n.model_id, "state": n.state, "round": n.round,
                       "published": n.published, "last_seen_s": round(n.last_seen_s, 3),
                       "summaries_held": given(n, "summaries_held"), "bundle_bytes_held": given(n, "bundle_bytes_held")}
                      for n in st.nodes],
            "pairs": [{"source": p.source, "receiver": p.receiver, "groups": p.groups,
                       "mean_s": p.mean_s if p.mean_s == p.mean_s else None,
                       "admitted_fraction": p.admitted_fraction if p.admitted_fraction == p.admitted_fraction else None,
                       "rejected": p.rejected, "reported": given(p, "reported"), "undelivered": given(p, "undelivered")}
                      for p in st.pairs],
            "pairs_total": max(st.pairs_total, len(st.pairs))}  # 0 from a broker older than the field


def _held(value: int | None, quota: int | None, unit: float = 1.0) -> str:
    """What a node holds against its quota, as the status table shows it: the count, and
    its share of the quota where there is one ("12,288 (0.1%)"); "?" from a broker older
    than the fields."""
    if value is None:
        return "?"
    shown = f"{value / unit:,.1f}" if unit != 1.0 else f"{value:,}"
    return f"{shown} ({100 * value / quota:.1f}%)" if quota else shown


def _quotas_line(summaries: int | None, bundle_bytes: int | None) -> str:
    if summaries is None or bundle_bytes is None:
        return "quotas per node: not shown by this broker (older than graft-fed's status fields for them)"
    return ("quotas per node: " + (f"{summaries:,} summaries" if summaries else "summaries unlimited") + ", "
            + (f"{bundle_bytes / 2**20:,.0f} MiB of bundles" if bundle_bytes else "bundles unlimited")
            + " (held: what the broker holds of each node, retention frees it)")


def _status_table(d: dict) -> str:
    from graft_fed.federation.limits import printable

    def shown(value: object) -> object:  # the broker's strings: a hostile one must not drive the terminal
        return printable(value, 256) if isinstance(value, str) else value

    d = {k: shown(v) for k, v in d.items()}
    d["manifest"] = {k: shown(v) for k, v in d["manifest"].items()}
    d["nodes"] = [{k: shown(v) for k, v in n.items()} for n in d["nodes"]]
    d["pairs"] = [{k: shown(v) for k, v in p.items()} for p in d["pairs"]]
    lines = [f"federation {d['federation_id']}: dataset {d['dataset_id']}, n={d['n']}, {d['prompts_per_round']} "
             f"prompts/round, round {d['current_round']}, {d['bundles']} bundles ({d['bundle_bytes'] / 2**20:.1f} MiB)",
             "manifest: " + ", ".join(f"{k} {v}" for k, v in d["manifest"].items()
                                      if k not in ("federation_id", "dataset_id", "n", "prompts_per_round")),
             _quotas_line(d["max_node_summaries"], d["max_node_bundle_bytes"]),
             f"{'node':<20} {'model':<20} {'state':<11} {'round':>6} {'published':>9} {'last seen':>9} "
             f"{'summaries held':>20} {'bundle MiB held':>18}"]
    for n in d["nodes"]:
        lines.append(f"{n['node_id']:<20} {n['model_id']:<20} {n['state']:<11} {n['round']:>6} {n['published']:>9} "
                     f"{n['last_seen_s']:>8.1f}s {_held(n['summaries_held'], d['max_node_summaries']):>20} "
                     f"{_held(n['bundle_bytes_held'], d['max_node_bundle_bytes'], 2**20):>18}")
    if d["pairs"]:
        lines.append("")
        if d["pairs_total"] > len(d["pairs"]):
            lines.append(f"{len(d['pairs'])} of {d['pairs_total']} pairs: those with the most groups (the broker's "
                         "max_pairs_shown)")
        lines.append(f"{'source -> receiver':<36} {'groups':>7} {'mean s':>7} {'admitted':>9} {'reported':>9} "
                     f"{'rejected':>9} {'undelivered':>12}")
        nan = float("nan")
        for p in d["pairs"]:
            ms = p["mean_s"] if p["mean_s"] is not None else nan
            af = p["admitted_fraction"] if p["admitted_fraction"] is not None else nan
            reported, undelivered = ("?" if p[k] is None else p[k] for k in ("reported", "undelivered"))
            lines.append(f"{p['source'] + ' -> ' + p['receiver']:<36} {p['groups']:>7} {ms:>7.3f} {af:>9.2f} "
                         f"{reported:>9} {p['rejected']:>9} {undelivered:>12}")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    import time

    from graft_fed.federation.errors import FederationError
    from graft_fed.node.client import BrokerClient

    if args.watch is not None and args.watch <= 0:
        raise GraftFedError(f"--watch {args.watch}: give the seconds between refreshes, more than 0")
    client = BrokerClient(args.broker, node_id="status", tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                          tls_key=args.tls_key, insecure=args.insecure)
    shown = False
    try:
        while True:
            try:
                d = _status_dict(client.status())
            except FederationError as exc:
                from graft_fed.federation.certcheck import explain_connect_failure

                cause = explain_connect_failure(args.broker, f"{exc.status} {exc}", bool(args.tls_ca),
                                                bool(args.tls_cert))
                message = f"cannot reach the broker at {args.broker}: {cause} [{exc.status} {exc}]"
                if args.watch is None or not shown:  # never reached: a wrong address or certificate
                    raise GraftFedError(message) from None
                # a broker that answered before and is restarting: keep watching until Ctrl-C
                print(f"graft-fed status: {message}; trying again in {args.watch:g} s", file=sys.stderr, flush=True)
                time.sleep(args.watch)
                continue
            shown = True
            if args.json:
                print(json.dumps(d), flush=True)  # one object per refresh: JSON Lines under --watch
            else:
                if args.watch is not None and sys.stdout.isatty():
                    print("\033[H\033[2J", end="")  # clear the terminal, like watch(1)
                print(_status_table(d), flush=True)
                if args.watch is not None:
                    print(f"\n(every {args.watch:g} s; Ctrl-C to stop)" if sys.stdout.isatty() else "", flush=True)
            if args.watch is None:
                return 0
            time.sleep(args.watch)
    finally:
        client.close()


def cmd_sim(args: argparse.Namespace) -> int:
    from graft_fed.sim import Simulation, load_sim_config

    cfg = load_sim_config(args.config, parse_overrides(args.set))
    if args.output_dir:
        import dataclasses
        cfg = dataclasses.replace(cfg, output_dir=args.output_dir)
    sim = Simulation(cfg, args.nodes, quiet=args.quiet)
    table = sim.run()
    print(table)
    if sim.failed:
        print(f"graft-fed sim: {len(sim.failed)} node(s) exited with an error: "
              + "; ".join(f"{n} (code {c}): {r}" for n, (c, r) in sim.failed.items()), file=sys.stderr)
        return 1
    return 0


def cmd_store(args: argparse.Namespace) -> int:
    from graft_fed.store import TrajectoryStore

    if args.store_command == "export":
        with TrajectoryStore(args.store, readonly=True) as store:
            n = store.export(args.out, run_id=args.run)
        print(f"wrote {n} groups to {args.out}")
    elif args.store_command == "import":
        n = TrajectoryStore.import_jsonl(args.file, args.store)
        print(f"imported {n} groups into {args.store}")
    else:
        with TrajectoryStore(args.store, readonly=True) as store:
            for run_id, model_id, count in store.runs():
                print(f"{run_id}\t{model_id}\t{count} groups")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from graft_fed.data.config import DataConfig, load_prompts
    from graft_fed.data.loaders import BENCHMARKS
    from graft_fed.evaluation import eval_conflict, eval_record, evaluate, write_eval
    from graft_fed.modeling import load_model_and_tokenizer, resolve_device
    from graft_fed.rewards import VerifierConfig, build_verifier

    bench = args.benchmark
    has_splits = bench.startswith("embedded:") or bench in BENCHMARKS or bench.startswith("hf:")
    if has_splits:
        data = DataConfig(source=bench, split=args.split, max_prompts=args.limit)
    else:
        data = DataConfig(source=bench, max_prompts=args.limit)
    prompts = load_prompts(data, benchmarks_root=args.benchmarks_dir)
    if args.k < 1 or args.max_new_tokens < 1 or args.batch_size < 1:
        raise GraftFedError("-k, --max-new-tokens and --batch-size must be at least 1")
    name = Path(bench).stem if Path(bench).suffix else bench.replace(":", "_")
    settings = eval_settings(args, args.split if has_splits else None)
    conflict = eval_conflict(Path(args.out) / f"{name}.summary.json", settings)
    if conflict and not args.overwrite:
        raise GraftFedError(f"{conflict}: choose another --out for this one, or pass --overwrite to replace it")
    device = resolve_device(args.device)
    model, tok = load_model_and_tokenizer(args.model, device)
    model.eval()
    template = args.template or ("chat" if getattr(tok, "chat_template", None) else "paper")
    settings["template_used"] = template
    with build_verifier(VerifierConfig(workers=args.workers)) as verifier:
        result = evaluate(model, tok, prompts, verifier, template=template,
                          add_special_tokens=template != "chat", k=args.k, temperature=args.temperature,
                          top_p=args.top_p, max_new_tokens=args.max_new_tokens, seed=args.seed,
                          batch_size=args.batch_size, seeding=args.seeding, progress=not args.quiet)
    path = write_eval(result, args.out, name, settings)
    if args.json:
        print(json.dumps(eval_record(result, settings), indent=2))
    else:
        print(f"{args.model} on {bench}:")
        print(result.table())
        if result.max_new_tokens < args.max_new_tokens:
            print(f"(new tokens capped at {result.max_new_tokens} of the {args.max_new_tokens} asked: the model's "
                  "context)")
    print(f"summary: {path}")
    print(f"per-prompt results: {path.with_suffix('').with_suffix('.jsonl')}")
    return 0


def eval_settings(args: argparse.Namespace, split: str | None) -> dict:
    """What a `graft-fed eval` summary records: the model and benchmark as given (and where
    they are local paths, resolved), and every setting that shapes the number."""
    from pathlib import Path

    from graft_fed import __version__

    def where(spec: str) -> str | None:
        return str(Path(spec).resolve()) if Path(spec).exists() else None

    return {"model": args.model, "model_path": where(args.model), "benchmark": args.benchmark,
            "benchmark_path": where(args.benchmark), "split": split, "limit": args.limit,
            "template": args.template or "default", "k": args.k, "temperature": args.temperature,
            "top_p": args.top_p, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
            "seeding": args.seeding, "batch_size": args.batch_size, "graft_fed_version": __version__}


def cmd_plot(args: argparse.Namespace) -> int:
    from graft_fed.plotting import plot_runs

    for path in plot_runs(args.run_dirs, args.out):
        print(path)
    return 0


def _run_arguments(p: argparse.ArgumentParser, example: str) -> None:
    """What `train` and `node` share: overrides, resume, evaluation and output."""
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override a config field, e.g. --set {example} (repeatable)")
    p.add_argument("--resume", nargs="?", const="auto", default=None, metavar="CKPT",
                   help="resume from a checkpoint directory, or from the latest one in run.output_dir")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation before and after")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    from graft_fed import __version__
    from graft_fed.rewards.cli import add_score_subparser
    from graft_fed.zoo.cli import add_zoo_subparser

    p = argparse.ArgumentParser(prog="graft-fed", description=__doc__)
    p.add_argument("--version", action="version", version=f"graft-fed {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train one model with GRPO on its own rollouts",
                       description="Train one model (GRPO). The YAML config is documented in docs/configuration.md.")
    t.add_argument("--config", help="run config YAML (default: built-in defaults)")
    _run_arguments(t, "run.steps=20")
    t.add_argument("--peer-store", metavar="PATH",
                   help="GRAFT stored mode: learn from the groups of a peer run's trajectories.sqlite")
    t.add_argument("--peer-run", metavar="RUN_ID", help="which run of the peer store (when it holds several)")
    t.set_defaults(func=cmd_train)

    c = sub.add_parser("cotrain", help="co-train N models with GRAFT exchange on one machine",
                       description="Co-train models on the same prompt batches with GRAFT exchange in every "
                                   "direction. The config is a train config plus `members`.")
    c.add_argument("--config", required=True, help="cotrain config YAML")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    c.add_argument("--resume", action="store_const", const="auto", default=None,
                   help="resume every member from its latest checkpoint")
    c.add_argument("--no-eval", action="store_true")
    c.add_argument("--quiet", action="store_true")
    c.set_defaults(func=cmd_cotrain)

    x = sub.add_parser("experiment", help="the paper's experiment in miniature (GRPO vs GRAFT and ablations)",
                       description="Run every arm of an experiment config over its seeds (resumable: finished "
                                   "runs are skipped) and write report.md with plots.")
    x.add_argument("--config", required=True, help="experiment YAML, e.g. bench/paper_miniature.yaml")
    x.add_argument("--quick", action="store_true", help="apply the config's `quick` overrides (minutes, not hours)")
    x.add_argument("--output-dir", help="override the config's output_dir")
    x.add_argument("--report-only", action="store_true", help="only (re)write the report from finished runs")
    x.add_argument("--reevaluate", action="store_true",
                   help="no training: score finished runs' final checkpoints again where they were evaluated "
                        "with other eval settings than the config's (then write the report)")
    x.add_argument("--seeds", type=int, nargs="+", help="run only these seeds of the config (e.g. one per process)")
    x.add_argument("--pairs", nargs="+", metavar="A+B", help="run only these pairs of the config, e.g. llama+qwen3")
    x.add_argument("--arms", nargs="+", metavar="ARM",
                   help="run only these arms of the config, e.g. grpo_n8 graft (the report covers them all)")
    x.add_argument("--quiet", action="store_true")
    x.set_defaults(func=cmd_experiment)

    b = sub.add_parser("broker", help="run a federation's broker",
                       description="Run the broker (config: docs/configuration.md#broker).")
    b.add_argument("--config", help="broker config YAML (default: built-in defaults)")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set listen=0.0.0.0:50551 (repeatable)")
    b.add_argument("--port-file", help="write the bound HOST:PORT here once listening (useful with port 0)")
    b.add_argument("--http-port-file", help="write the HTTP port's address (live page, /metrics) here once listening")
    b.set_defaults(func=cmd_broker)
    bn = b.add_subparsers(dest="broker_sub")
    nodes = bn.add_parser("nodes", help="the operator's allowlist: add, list or revoke nodes")
    nodes_sub = nodes.add_subparsers(dest="nodes_command", required=True)
    for action, help_ in (("add", "allow a node"), ("list", "list the allowlist"),
                          ("revoke", "revoke a node: refused at its next call"),
                          ("release", "lift a node's automatic quarantine (trust it)")):
        a = nodes_sub.add_parser(action, help=help_)
        a.add_argument("--allowlist", required=True, help="the allowlist YAML (broker config key `allowlist`)")
        if action != "list":
            a.add_argument("name")

    fs = bn.add_parser("forget-secret", help="give a node id back: let the next Join under it hold it with its own "
                                             "node secret, or hold it for one node's secret (--hold-for), and end "
                                             "the session under it (a node that lost its node_secret file, or an "
                                             "id taken first by another); with the broker running or stopped")
    fs.add_argument("--db", required=True, help="the broker's state file (broker config key `db`)")
    fs.add_argument("--hold-for", metavar="SHA256", default=None,
                    help="hold the id for the node whose secret has this hash (its operator prints it with "
                         "`graft-fed node --config <its config> --print-secret-hash`): a taker online cannot join "
                         "again first")
    fs.add_argument("--wait-s", type=float, default=30.0,
                    help="with the broker running: how long to wait for its answer (default 30)")
    fs.add_argument("node_id")
    fs.set_defaults(forget_secret=True)

    ce = sub.add_parser("certs", help="the federation's certificate authority: init, issue, revoke")
    ce_sub = ce.add_subparsers(dest="certs_command", required=True)
    ci = ce_sub.add_parser("init", help="create the federation CA")
    ci.add_argument("--dir", required=True)
    ci.add_argument("--federation", default="graft-fed")
    ci.add_argument("--days", type=int, default=3650)
    cs = ce_sub.add_parser("issue", help="issue a node's or the broker's certificate (its name is its identity)")
    cs.add_argument("--dir", required=True)
    cs.add_argument("--name", required=True)
    cs.add_argument("--hosts", help="comma-separated DNS names / IPs a server is reached at")
    cs.add_argument("--days", type=int, default=825)
    cr = ce_sub.add_parser("revoke", help="record a revocation")
    cr.add_argument("--dir", required=True)
    cr.add_argument("--name", required=True)
    ce.set_defaults(func=cmd_certs)

    nd = sub.add_parser("node", help="run a federation node (a trainer that exchanges through the broker)")
    nd.add_argument("--config", required=True, help="node config YAML: a train config plus `federation`")
    _run_arguments(nd, "federation.broker=HOST:PORT")
    nd.add_argument("--print-secret-hash", action="store_true",
                    help="print the hash of this node's secret (made in run.output_dir when there is none) and exit: "
                         "what the broker's operator needs to hold the node id for it "
                         "(`graft-fed broker forget-secret --hold-for`); the hash does not let anyone join as the node")
    nd.add_argument("--join-timeout", type=float, default=120.0, metavar="SECONDS",
                    help="exit with the cause when the first Join has not succeeded within SECONDS "
                         "(default 120; 0: start training alone and keep trying, the degraded mode)")
    nd.set_defaults(func=cmd_node)

    ss = sub.add_parser("status", help="print a live federation: nodes, rounds, exchange and compatibility")
    ss.add_argument("--broker", required=True, help="HOST:PORT of the broker")
    ss.add_argument("--tls-ca", help="federation CA (PEM): use TLS")
    ss.add_argument("--tls-cert", help="a certificate for mutual TLS")
    ss.add_argument("--tls-key", help="its key")
    ss.add_argument("--insecure", action="store_true", help="allow plaintext to a non-loopback broker")
    ss.add_argument("--json", action="store_true", help="print JSON (one object per refresh with --watch)")
    ss.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                    help="refresh every SECONDS (default 2) until interrupted")
    ss.set_defaults(func=cmd_status)

    sm = sub.add_parser("sim", help="a broker and N node processes on this machine, over loopback gRPC")
    sm.add_argument("--config", required=True, help="sim config YAML, e.g. configs/sim-zoo.yaml")
    sm.add_argument("--nodes", type=int, default=3, help="how many of the config's nodes to run (default 3)")
    sm.add_argument("--output-dir", help="override the config's output_dir (a folder no earlier sim used)")
    sm.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field, e.g. --set base.run.steps=5 or --set broker.seed=1 (repeatable)")
    sm.add_argument("--quiet", action="store_true")
    sm.set_defaults(func=cmd_sim)

    st = sub.add_parser("store", help="inspect, export or import a trajectory store")
    st_sub = st.add_subparsers(dest="store_command", required=True)
    ls = st_sub.add_parser("list", help="runs in a store")
    ls.add_argument("store")
    ex = st_sub.add_parser("export", help="export to JSONL or Parquet")
    ex.add_argument("store")
    ex.add_argument("out", help="output .jsonl or .parquet")
    ex.add_argument("--run", help="only this run id")
    im = st_sub.add_parser("import", help="import an exported JSONL into a store")
    im.add_argument("file")
    im.add_argument("store")
    st.set_defaults(func=cmd_store)

    e = sub.add_parser("eval", help="pass@1 of a model on a benchmark or prompt file")
    e.add_argument("--model", required=True, help="model directory or zoo:<name>")
    e.add_argument("--benchmark", required=True,
                   help="benchmark name (math500, aime24, aime25, amc23, minerva, olympiadbench, gsm8k), "
                        "a JSONL/Parquet file, embedded:arith-v1, or hf:<hub id>")
    e.add_argument("--benchmarks-dir", help="folder of the benchmark JSONL files (or $GRAFT_FED_BENCHMARKS_DIR)")
    e.add_argument("--split", default="test", help="split for embedded/hub datasets (default: test)")
    e.add_argument("--limit", type=int, help="evaluate only the first N prompts")
    e.add_argument("--template", help="prompt template (default: chat when the tokenizer has one, else paper)")
    e.add_argument("-k", type=int, default=8, help="samples per prompt (default: 8)")
    e.add_argument("--temperature", type=float, default=0.6)
    e.add_argument("--top-p", type=float, default=0.95)
    e.add_argument("--max-new-tokens", type=int, default=4096 // 16)
    e.add_argument("--batch-size", type=int, default=64)
    e.add_argument("--seed", type=int, default=1234)
    e.add_argument("--seeding", choices=("stream", "prompt"), default="stream",
                   help="prompt: key each prompt's samples by (seed, prompt id), so two models are scored on "
                        "the same random numbers and batch size does not matter (default: stream)")
    e.add_argument("--workers", type=int, default=2, help="verifier processes")
    e.add_argument("--device", default="auto")
    e.add_argument("--out", default="runs/eval",
                   help="output folder (default: runs/eval); BENCH.summary.json and BENCH.jsonl there, and an "
                        "evaluation of another model or with other settings already there is refused")
    e.add_argument("--overwrite", action="store_true",
                   help="replace the evaluation already in --out for this benchmark (of another model or settings)")
    e.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    e.add_argument("--quiet", action="store_true", help="no progress lines")
    e.set_defaults(func=cmd_eval)

    pl = sub.add_parser("plot", help="draw a run's learning curves (and federation panels) to PNG; "
                                     "several runs are overlaid",
                        description="One run: learning_curves.png and, where it received peer groups, "
                                    "federation.png. Several runs, or a sim's output folder: the same overlaid.")
    pl.add_argument("run_dirs", nargs="+", metavar="RUN", help="run folder(s), or a sim's output folder")
    pl.add_argument("--out", help="output folder (default: RUN/plots; for several runs, their common folder's plots)")
    pl.set_defaults(func=cmd_plot)

    add_score_subparser(sub)
    add_zoo_subparser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # this process is the command (`graft-fed ...`, `python -m graft_fed.cli ...`), not a
    # program calling main(): only then may `graft-fed broker` run the process again
    args.as_command = argv is None
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    code = _run(args)
    # a torchrun process ends here, without the interpreter finalisation that races torch's
    # gloo threads (end_process); the module is loaded only by commands that can join a group
    dist_module = sys.modules.get("graft_fed.trainer.distributed")
    return dist_module.end_process(code) if dist_module is not None else code


def _quiet_libraries() -> None:
    """`--quiet`: no progress bars from the libraries either (transformers draws one for every
    model it loads and every checkpoint it writes: a line each in a node's log)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


class Terminated(KeyboardInterrupt):
    """SIGTERM (`docker stop`, a Kubernetes pod's end, `systemctl stop`, torchrun ending its
    workers): the command unwinds as it does on Ctrl-C, so a node leaves the federation at
    once (peers stop waiting for it) and its reward workers and run-folder lock are let go.
    A second SIGTERM ends the process at once."""


def _on_sigterm(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Terminated()


def _unwind_on_sigterm():  # noqa: ANN202 - the handler it replaced, to put back; None off the main thread
    try:
        return signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # main() called from another thread: signals go to the main one
        return None


def _run(args: argparse.Namespace) -> int:
    before = _unwind_on_sigterm()
    try:
        return _command(args)
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


def _command(args: argparse.Namespace) -> int:
    try:
        if getattr(args, "quiet", False):
            _quiet_libraries()
        if args.command not in ("train", "cotrain", "node") and "WORLD_SIZE" in os.environ:
            from graft_fed.trainer.distributed import launched_by_torchrun

            if launched_by_torchrun():
                raise GraftFedError("only train, cotrain and node run under torchrun (each model sharded over "
                                    f"the processes); run {args.command} as one process")
        return int(args.func(args) or 0)
    except GraftFedError as exc:
        print(f"graft-fed {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"graft-fed {args.command}: stopped by SIGTERM", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"graft-fed {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`graft-fed status | head`): stop quietly, as a C tool would on SIGPIPE
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141


if __name__ == "__main__":
    sys.exit(main())
