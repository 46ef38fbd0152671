"""The ``pipekernel`` command.

Each subcommand is one ``_add_<name>(subparsers)`` function that declares its
arguments and sets ``func``; :func:`main` calls every function in
``SUBCOMMANDS``. Heavy imports happen inside the subcommand that needs them.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser"]


# -- pipekernel plugins ----------------------------------------------------------------------


def _add_plugins(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plugins", help="list installed transports, plugins, schedules, precisions, partitions",
        description="List what is installed — transports, plugins, schedules, precision "
                    "policies and partition methods — each with the distribution and version "
                    "it comes from. Transports are listed from entry-point metadata without "
                    "importing them.")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--no-autoload", action="store_true",
                   help="do not load third-party plugins (as an embedded host would)")
    p.add_argument("--disable", action="append", default=[], metavar="NAME",
                   help="treat plugin NAME as disabled (repeatable)")
    p.set_defaults(func=_run_plugins)


def _run_plugins(args: argparse.Namespace) -> int:
    from pipekernel.inventory import format_inventory, inventory

    found = inventory(autoload=False if args.no_autoload else None, disabled=args.disable)
    print(format_inventory(found, as_json=args.json))
    return 0


# -- the command -----------------------------------------------------------------------------

#: One function per subcommand; each adds its parser and sets ``func``.
SUBCOMMANDS = [_add_plugins]


def build_parser() -> argparse.ArgumentParser:
    from pipekernel import __version__

    parser = argparse.ArgumentParser(
        prog="pipekernel", description="pipekernel: pipeline-parallel training for PyTorch")
    parser.add_argument("--version", action="version", version=f"pipekernel {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pipekernel`` console script; returns the exit status."""
    from pipekernel.errors import PipelineError

    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except PipelineError as err:  # user-caused: the message says what and how to fix
        print(f"pipekernel {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
