"""`sluice bench serve --help` and `sluice bench offline --help`: each option's help
states its default once, and never argparse's bare "None"."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from help_text import options_without_one_default
from sluice.bench.cli import add_serve_arguments
from sluice.bench.offline import add_arguments


@pytest.mark.parametrize("add", [add_serve_arguments, add_arguments], ids=["serve", "offline"])
def test_help_states_each_default_once(add: Callable[[argparse.ArgumentParser], None]) -> None:
    """`bench offline --help` showed nothing for --max-num-batched-tokens (2048), --seed,
    --workload, --quantization; `bench serve --help` nothing for --seed, --workload,
    --endpoint, --burstiness (1) and the options whose absence means off."""
    assert options_without_one_default(add) == []
