"""`sluice sim --help` and `sluice sim calibrate --help`: each option's help states its
default once, and never argparse's bare "None"."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from help_text import options_without_one_default
from sluice.sim.cli import add_calibrate_arguments, add_run_arguments


@pytest.mark.parametrize("add", [add_run_arguments, add_calibrate_arguments],
                         ids=["sim", "calibrate"])
def test_help_states_each_default_once(add: Callable[[argparse.ArgumentParser], None]) -> None:
    """`sluice sim --help` showed nothing for --seed, --scrape-interval's 0.5,
    --kv-event-lag-ms, --prefix-index-blocks, and 'override the profile's' without saying
    the profile's is the default; `calibrate --help` nothing for --repeats (3)."""
    assert options_without_one_default(add) == []
