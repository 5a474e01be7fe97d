"""`graft-fed score`: score a responses file against a references file."""

from __future__ import annotations

import argparse
import json
import sys

from graft_fed.rewards.config import VerifierConfig


def add_score_subparser(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Register `score`; the parsed namespace's `func(args) -> int` runs it."""
    defaults = VerifierConfig()
    parser = subparsers.add_parser(
        "score", help="score responses against reference answers with the verifier",
        description="Score JSONL responses {id, response} against JSONL references {id, answer}. "
                    "Prints a JSON summary; --out writes one {id, reward, status} line per response.")
    parser.add_argument("--responses", required=True, metavar="FILE", help="JSONL of {id, response}")
    parser.add_argument("--references", required=True, metavar="FILE", help="JSONL of {id, answer}")
    parser.add_argument("--out", metavar="FILE", help="write per-response {id, reward, status} JSONL here")
    parser.add_argument("--verifier", default=defaults.name,
                        help="'math_verify' or a plugin 'package.module:function' (default: %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=defaults.timeout_s,
                        help="wall-clock limit per response in seconds (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=defaults.workers,
                        help="verifier worker processes (default: %(default)s)")
    parser.add_argument("--no-fast-path", action="store_true",
                        help="always run math-verify, even when the boxed answer equals the gold string")
    parser.add_argument("--allow-missing", action="store_true",
                        help="score responses whose id has no reference as 0 (status missing_reference) "
                             "instead of refusing the files")
    parser.set_defaults(func=run_score)
    return parser


def unpaired_response_ids(responses: str, references: str) -> list:
    """Ids of responses that have no reference (in first-seen order), read before any scoring."""
    from pathlib import Path

    from graft_fed.rewards.files import _rows

    known = {str(row_id) for _, row_id, _ in _rows(Path(references), "references", "answer")}
    missing: dict[str, object] = {}
    for _, row_id, _ in _rows(Path(responses), "responses", "response"):
        if str(row_id) not in known:
            missing.setdefault(str(row_id), row_id)
    return list(missing.values())


def run_score(args: argparse.Namespace) -> int:
    from graft_fed.errors import DataError
    from graft_fed.rewards.files import score_files

    if not args.allow_missing:
        missing = unpaired_response_ids(args.responses, args.references)
        if missing:
            shown = ", ".join(map(repr, missing[:10])) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
            raise DataError(f"{len(missing)} response id(s) have no reference in {args.references}: {shown}; "
                            "fix the ids, or pass --allow-missing to score them as 0")

    cfg = VerifierConfig(name=args.verifier, timeout_s=args.timeout_s, workers=args.workers,
                         exact_match_fast_path=not args.no_fast_path)
    summary = score_files(args.responses, args.references, args.out, cfg)
    json.dump(summary, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
