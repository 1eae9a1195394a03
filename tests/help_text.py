"""What the `--help` tests of several commands check: every option's help states its
default once, and never argparse's bare "None"."""

from __future__ import annotations

import argparse
from collections.abc import Callable

SWITCHES = (argparse._HelpAction, argparse._StoreTrueAction, argparse._StoreFalseAction)


def options_without_one_default(add: Callable[[argparse.ArgumentParser], None]) -> list[str]:
    """The options `add` puts on a parser (on/off switches aside) whose help says
    "default" other than once, or says None; each as `--flag: 'help text'`."""
    parser = argparse.ArgumentParser()
    add(parser)
    formatter = parser._get_formatter()
    return [f"{action.option_strings[0]}: {text!r}" for action in parser._actions
            if not isinstance(action, SWITCHES)
            and ((text := formatter._expand_help(action) if action.help else "")
                 .count("default") != 1 or "None" in text)]
