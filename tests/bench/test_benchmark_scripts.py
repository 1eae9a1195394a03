"""`python benchmarks/X.py --help` describes the benchmark in whole sentences: each
script's parser takes its module docstring's first paragraph (or all of it), and that
paragraph ends a sentence. Read from the source (ast): running 31 scripts that import
torch is not a unit test; `for f in benchmarks/*.py; do python $f --help; done` is the
manual check."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parents[2] / "benchmarks").glob("*.py"))
WHOLE = {'__doc__', '__doc__.split("\\n\\n")[0]'}  # the docstring, or its first paragraph


def descriptions(tree: ast.Module) -> list[str]:
    return [ast.unparse(kw.value).replace("'", '"') for node in ast.walk(tree)
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("ArgumentParser")
            for kw in node.keywords if kw.arg == "description"]


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_help_describes_the_benchmark_in_whole_sentences(script: Path) -> None:
    """worker_overhead.py's said 'What the HTTP server costs: ... through `sluice worker`
    vs the' (its docstring's first line), serve_ttft.py's '... against its workers
    reached'; offline.py's said nothing."""
    tree = ast.parse(script.read_text())
    assert descriptions(tree) and set(descriptions(tree)) <= WHOLE
    assert (ast.get_docstring(tree) or "").split("\n\n")[0].rstrip().endswith(".")
