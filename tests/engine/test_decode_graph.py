"""The decode graph (sluice.engine.decode_graph): a decode step of every layer and the
head in one native call on the GGUF blocks, against the torch model on the same blocks
(`enforce_eager`), on the default model: the same logits within float rounding, the
same K/V rows in the pools, the same greedy tokens; which steps it takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.engine.config import EngineConfig
from sluice.engine.decode_graph import GRAPH_MAX_ROWS
from sluice.engine.llm import LLM
from sluice.engine.model_runner import ModelRunner, SeqChunk
from sluice.engine.models.llama import TransformerBlock
from sluice.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.model

PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ",
           "Here are three tips for staying healthy:\n1.")


def runner(dtype: str, eager: bool) -> ModelRunner:
    return ModelRunner(EngineConfig.from_options(None, num_kv_blocks=64, quantization="gguf",
                                                 dtype=dtype, enforce_eager=eager))


@pytest.fixture(scope="module")
def pair() -> tuple[ModelRunner, ModelRunner]:
    """(torch model, graph), float32: the graph's activations are float32 too."""
    return runner("float32", True), runner("float32", False)


def prefill(r: ModelRunner, ids: list[int], table: list[int]) -> int:
    """The prompt through the torch model (8+ tokens: never the graph); its greedy token."""
    return int(r.execute([SeqChunk(ids, 0, table, True)])[0].argmax())


def pool_rows(r: ModelRunner, slots: list[int]) -> torch.Tensor:
    """Every layer's K and V at `slots`, stacked."""
    rows = []
    for layer in r.model.layers:
        assert isinstance(layer, TransformerBlock) and layer.attention.kv_cache is not None
        cache = layer.attention.kv_cache
        for pool in (cache.k, cache.v):
            rows.append(pool.view(-1, *pool.shape[2:])[slots])
    return torch.stack(rows)


def test_built_for_gguf_only_and_not_when_eager(pair: tuple[ModelRunner, ModelRunner]) -> None:
    eager, graph = pair
    assert graph.decode_graph is not None and eager.decode_graph is None
    dense = ModelRunner(EngineConfig.from_options(None, num_kv_blocks=16, dtype="float32"))
    assert dense.decode_graph is None  # no GGUF blocks: the torch model runs every step


def test_mixed_decodes_and_a_verify_match_the_torch_model(
        pair: tuple[ModelRunner, ModelRunner]) -> None:
    """Three sequences at different lengths (different block tables), then one step with
    two decodes and a 3-token verify: logits and the K/V rows written agree."""
    eager, graph = pair
    seqs = [(eager.tokenizer.encode(p), list(range(8 * i, 8 * i + 8)))
            for i, p in enumerate(PROMPTS)]
    firsts = [(prefill(eager, ids, t), prefill(graph, ids, t)) for ids, t in seqs]
    assert all(a == b for a, b in firsts)
    (a, ta), (b, tb), (c, tc) = seqs
    chunks = [SeqChunk([firsts[0][0]], len(a), ta, True),
              SeqChunk([firsts[1][0], 11, 12], len(b), tb, True, num_logits=3),
              SeqChunk([firsts[2][0]], len(c), tc, True)]
    calls = []
    forward = graph.decode_graph.forward  # type: ignore[union-attr]
    graph.decode_graph.forward = lambda *args: calls.append(1) or forward(*args)  # type: ignore
    try:
        got = graph.execute(chunks)
    finally:
        del graph.decode_graph.forward  # type: ignore[union-attr]
    want = eager.execute(chunks)
    assert calls == [1] and got.shape == want.shape == (5, graph.vocab_size)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * float(want.abs().max()))
    assert (got.argmax(-1) == want.argmax(-1)).all()
    bs = graph.block_size
    slots = [ta[len(a) // bs] * bs + len(a) % bs, tc[len(c) // bs] * bs + len(c) % bs] + [
        tb[p // bs] * bs + p % bs for p in range(len(b), len(b) + 3)]
    torch.testing.assert_close(pool_rows(graph, slots), pool_rows(eager, slots),
                               rtol=1e-4, atol=1e-4)


def test_only_rows_that_want_logits_come_back(pair: tuple[ModelRunner, ModelRunner]) -> None:
    eager, graph = pair
    ids, table = eager.tokenizer.encode(PROMPTS[0]), list(range(40, 48))
    first = prefill(eager, ids, table)
    prefill(graph, ids, table)
    chunks = [SeqChunk([first], len(ids), table, False),
              SeqChunk([first, 5], len(ids) + 1, table, True, num_logits=2)]
    got, want = graph.execute(chunks), eager.execute(chunks)
    assert got.shape == want.shape == (2, graph.vocab_size)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * float(want.abs().max()))


def test_steps_it_takes(pair: tuple[ModelRunner, ModelRunner]) -> None:
    _, graph = pair
    table = list(range(8))
    decode = SeqChunk([1], 20, table, True)
    assert graph._graph_takes([decode] * GRAPH_MAX_ROWS)
    assert not graph._graph_takes([decode] * (GRAPH_MAX_ROWS + 1))  # oneDNN's batch
    assert graph._graph_takes([SeqChunk([1, 2, 3], 20, table, True, num_logits=3)])
    assert not graph._graph_takes([decode, SeqChunk([1, 2], 20, table, True)])  # a prefill


def test_lora_keeps_the_torch_model() -> None:
    lora = ModelRunner(EngineConfig.from_options(None, num_kv_blocks=16, quantization="gguf",
                                                 enable_lora=True))
    assert lora.decode_graph is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_generation_matches_the_torch_model(dtype: str, default_gguf: Path) -> None:
    """Whole requests through the engine (prefill on the torch model, decodes on the
    graph, two at a time): the same greedy tokens as the torch model on the same blocks
    (float32); in bfloat16 the torch path rounds activations, the graph does not, so
    only the first tokens must agree."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(str(default_gguf), quantization="gguf", dtype=dtype, enforce_eager=eager,
                  num_kv_blocks=64, max_num_seqs=2)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(list(PROMPTS), params)]
    if dtype == "float32":
        assert outs[True] == outs[False]
    else:
        agree = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                 for x, y in zip(outs[True], outs[False], strict=True)]
        print("bfloat16: greedy tokens agreeing before the first difference:", agree)
        assert min(agree) >= 4 and sum(agree) >= 0.5 * 32 * len(PROMPTS)
