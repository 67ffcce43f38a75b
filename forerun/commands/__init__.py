"""Subcommands of `forerun`; a module here with a `register(subparsers)` function becomes one."""
