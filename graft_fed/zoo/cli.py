"""`graft-fed zoo ...` subcommands: attach with add_zoo_subparser(subparsers)."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any, Sequence


def _build(args: argparse.Namespace) -> int:
    from graft_fed.zoo.build import run_build

    return run_build(args)


def _measure(args: argparse.Namespace) -> int:
    from graft_fed.zoo.measure import run_measure

    return run_measure(args, "graft-fed " + " ".join(shlex.quote(a) for a in sys.argv[1:]))


def _list(args: argparse.Namespace) -> int:
    from graft_fed.zoo import ZOO_NAMES, zoo_dir

    for name in ZOO_NAMES:
        path = zoo_dir() / name
        print(f"zoo:{name}\t{path}{'' if (path / 'config.json').is_file() else '  (not built)'}")
    return 0


def add_zoo_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `zoo` with `build`, `measure` and `list`; each leaf sets `func(args) -> int`."""
    from graft_fed.zoo.build import add_build_arguments
    from graft_fed.zoo.measure import add_measure_arguments

    zoo = subparsers.add_parser("zoo", help="the embedded tiny-model zoo: build, measure, list")
    sub = zoo.add_subparsers(dest="zoo_command", required=True)
    b = sub.add_parser("build", help="train the zoo models from a seed (SFT warm start)")
    add_build_arguments(b)
    b.set_defaults(func=_build)
    m = sub.add_parser("measure", help="sampled accuracy, all-fail groups and pair complementarity")
    add_measure_arguments(m)
    m.set_defaults(func=_measure)
    ls = sub.add_parser("list", help="the zoo names and where they are")
    ls.set_defaults(func=_list)
    return zoo


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graft-fed")
    add_zoo_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
