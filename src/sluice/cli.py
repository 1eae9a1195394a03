"""The `sluice` command: one entry point, a subcommand per role.

Each role's package owns its own arguments in a `cli` module with
`register(subparsers)`; this file only lists them, so adding a role is one line here.
Modules are imported lazily so that `sluice bench` never pays for torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

# subcommand -> module that defines `register(subparsers)`
COMMANDS: dict[str, str] = {
    "serve": "sluice.serve",
    "worker": "sluice.worker.cli",
    "router": "sluice.router.cli",
    "gateway": "sluice.gateway.cli",
    "keys": "sluice.gateway.cli",
    "tenants": "sluice.gateway.cli",
    "usage": "sluice.gateway.cli",
    "bench": "sluice.bench.cli",
    "sim": "sluice.sim.cli",
    "top": "sluice.observe.top",
    "deploy": "sluice.control.cli",
}


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser. An unknown option's value is not taken for a subcommand:
    `sluice sim --num-sessions 4` (a bench flag) is "unrecognized arguments:
    --num-sessions 4", not "argument SIM: invalid choice: '4'"."""

    _argv: tuple[str, ...] = ()  # what the last parse_known_args was given

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._argv = tuple(args or ())
        return super().parse_known_args(args, namespace)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if isinstance(action, argparse._SubParsersAction) and value not in (action.choices or {}):
            for before, word in zip(self._argv, self._argv[1:], strict=False):
                option = before.split("=", 1)[0]
                if (word == value and option.startswith("-")
                        and option not in self._option_string_actions):
                    raise argparse.ArgumentError(None, f"unrecognized arguments: {before} {word}")
        super()._check_value(action, value)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="sluice: an LLM serving stack")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    wanted = argv[0] if argv and argv[0] in COMMANDS else None
    modules = [COMMANDS[wanted]] if wanted else list(dict.fromkeys(COMMANDS.values()))
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if wanted or not exc.name or not exc.name.startswith("sluice"):
                raise
            continue  # a role not built yet is simply not listed
        module.register(sub)
    return parser


def chosen(parser: argparse.ArgumentParser,
           args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost (sub)command parser `args` came through, so that an error names
    `sluice bench serve` with its usage rather than the top level's `COMMAND ...`."""
    while True:
        action = next((a for a in parser._actions
                       if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, action.dest, None) if action else None
        if action is None or name not in action.choices:
            return parser
        parser = action.choices[name]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        chosen(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
