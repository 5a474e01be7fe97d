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
    parser.set_defaults(func=run_score)
    return parser


def run_score(args: argparse.Namespace) -> int:
    from graft_fed.rewards.files import score_files

    cfg = VerifierConfig(name=args.verifier, timeout_s=args.timeout_s, workers=args.workers,
                         exact_match_fast_path=not args.no_fast_path)
    summary = score_files(args.responses, args.references, args.out, cfg)
    json.dump(summary, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
