"""`sluice bench serve --help` and `sluice bench offline --help`: each option's help
states its default once, and never argparse's bare "None"."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from sluice.bench.cli import add_serve_arguments
from sluice.bench.offline import add_arguments

SWITCHES = (argparse._HelpAction, argparse._StoreTrueAction, argparse._StoreFalseAction)


def options_without_one_default(add: Callable[[argparse.ArgumentParser], None]) -> list[str]:
    parser = argparse.ArgumentParser()
    add(parser)
    formatter = parser._get_formatter()
    return [f"{action.option_strings[0]}: {text!r}" for action in parser._actions
            if not isinstance(action, SWITCHES)
            and ((text := formatter._expand_help(action) if action.help else "")
                 .count("default") != 1 or "None" in text)]


@pytest.mark.parametrize("add", [add_serve_arguments, add_arguments], ids=["serve", "offline"])
def test_help_states_each_default_once(add: Callable[[argparse.ArgumentParser], None]) -> None:
    """`bench offline --help` showed nothing for --max-num-batched-tokens (2048), --seed,
    --workload, --quantization; `bench serve --help` nothing for --seed, --workload,
    --endpoint, --burstiness (1) and the options whose absence means off."""
    assert options_without_one_default(add) == []
