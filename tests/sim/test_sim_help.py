"""`sluice sim --help` and `sluice sim calibrate --help`: each option's help states its
default once, and never argparse's bare "None"."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from sluice.sim.cli import add_calibrate_arguments, add_run_arguments

SWITCHES = (argparse._HelpAction, argparse._StoreTrueAction, argparse._StoreFalseAction)


def options_without_one_default(add: Callable[[argparse.ArgumentParser], None]) -> list[str]:
    parser = argparse.ArgumentParser()
    add(parser)
    formatter = parser._get_formatter()
    return [f"{action.option_strings[0]}: {text!r}" for action in parser._actions
            if not isinstance(action, SWITCHES) and ((text := formatter._expand_help(action) if action.help else "")
                 .count("default") != 1 or "None" in text)]


@pytest.mark.parametrize("add", [add_run_arguments, add_calibrate_arguments],
                         ids=["sim", "calibrate"])
def test_help_states_each_default_once(add: Callable[[argparse.ArgumentParser], None]) -> None:
    """`sluice sim --help` showed nothing for --seed, --scrape-interval's 0.5,
    --kv-event-lag-ms, --prefix-index-blocks, and 'override the profile's' without saying
    the profile's is the default; `calibrate --help` nothing for --repeats (3)."""
    assert options_without_one_default(add) == []
