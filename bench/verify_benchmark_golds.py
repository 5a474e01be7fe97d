"""Score every gold answer of every benchmark file, given back boxed, with math-verify.

The fast path is OFF, so math-verify really parses and compares each gold with itself:
a gold that does not score 1 is one the verifier cannot handle (a parsing gap), and
every model answer to that problem would be marked wrong however it is written.

    python bench/verify_benchmark_golds.py /work/shared/data/benchmarks [--show-failures]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from graft_fed.data.loaders import BENCHMARKS, load_benchmark
from graft_fed.rewards import VerifierConfig, build_verifier


def string_only(gold: str) -> bool:
    """True when math-verify parses the boxed gold to no sympy object, only its string fallback.

    Such a gold scores 1 against itself by string equality alone; an equivalent answer
    written differently would score 0. Run in-process: the golds are trusted input.
    """
    from sympy import Basic, MatrixBase

    from graft_fed.rewards.mathverify import parse_boxed

    return not any(isinstance(x, (Basic, MatrixBase)) for x in parse_boxed(gold))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="benchmarks directory")
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--show-failures", action="store_true", help="print each gold that does not score 1")
    args = parser.parse_args(argv)

    known = {b.filename: name for name, b in BENCHMARKS.items()}
    files = sorted(p for p in args.root.iterdir() if p.suffix in (".jsonl", ".parquet"))
    if not files:
        print(f"no .jsonl/.parquet files in {args.root}", file=sys.stderr)
        return 2
    cfg = VerifierConfig(exact_match_fast_path=False, timeout_s=args.timeout_s, workers=args.workers)
    total_bad = 0
    print(f"{'file':<22} {'benchmark':<14} {'n':>5} {'scored 1':>9} {'timeouts':>9} {'errors':>7} {'str-only':>8} {'seconds':>8}")
    with build_verifier(cfg) as verifier:
        for path in files:
            prompts = load_benchmark(path)
            golds = [p.answer for p in prompts]
            start = time.monotonic()
            result = verifier.score(["\\boxed{" + g + "}" for g in golds], golds)
            seconds = time.monotonic() - start
            ones = sum(1 for r in result.rewards if r == 1.0)
            weak = [p for p in prompts if string_only(p.answer)]
            total_bad += len(golds) - ones
            print(f"{path.name:<22} {known.get(path.name, '-'):<14} {len(golds):>5} {ones:>9} "
                  f"{result.timeouts:>9} {result.errors:>7} {len(weak):>8} {seconds:>8.1f}")
            if args.show_failures:
                for prompt, reward, status in zip(prompts, result.rewards, result.statuses):
                    if reward != 1.0:
                        print(f"    [{status}] {prompt.id} gold={prompt.answer!r}")
                for prompt in weak:
                    print(f"    [string-only] {prompt.id} gold={prompt.answer!r}")
        print(f"math-verify {verifier.version}; golds not scoring 1: {total_bad}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
