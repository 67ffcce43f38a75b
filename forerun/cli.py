"""The `forerun` command: each subcommand lives in forerun/commands/ and registers itself."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from forerun.base.errors import ForerunError


def build_parser() -> argparse.ArgumentParser:
    import forerun.commands as commands

    parser = argparse.ArgumentParser(prog="forerun", description="Speculative decoding with exact output.")
    sub = parser.add_subparsers(dest="command", required=True)
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"forerun.commands.{info.name}")
        if hasattr(module, "register"):
            module.register(sub)
    return parser


def handler(args: argparse.Namespace):
    """The function that runs the parsed command: `forerun serve --ray` goes to the replicas under Ray
    Serve (forerun/cluster/app.py), which build on `forerun serve`'s own pieces."""
    if args.command == "serve" and args.ray:
        from forerun.cluster.app import run_cluster

        return run_cluster
    return args.func


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(handler(args)(args) or 0)
    except ForerunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
