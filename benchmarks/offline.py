"""Offline engine benchmark: `python benchmarks/offline.py [options]` = `sluice bench offline`."""

from __future__ import annotations

import argparse
import sys

from sluice.bench import offline

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="benchmarks/offline.py", description=__doc__)
    offline.add_arguments(parser)
    sys.exit(offline.run(parser.parse_args()))
