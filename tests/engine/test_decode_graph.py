"""The decode graph (sluice.engine.decode_graph): a decode step of every layer and the
head in one native call on the GGUF blocks.

- Its Q4 x int8 linear alone against a float64 reference that quantizes the activations
  the same way (exact up to float rounding), and against the float product.
- On the default model, with float activations, against the torch model on the same
  blocks (`enforce_eager`): the same logits within float rounding, the same K/V rows in
  the pools, the same greedy tokens; which steps it takes.
- With int8 activations (the default where the CPU has AVX2): perplexity within 1% of
  the dequantized float32 model, teacher-forced through the graph one token a step,
  and greedy agreement with it, printed.
- On float32 weights and their native panels (`build_float`, CPUs without AVX-512;
  here on any CPU): every decode step, 1 row or 40, against the torch model on the same
  weights; the same greedy tokens through the engine."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sluice.engine.config import EngineConfig
from sluice.engine.decode_graph import (
    F32,
    GRAPH_MAX_ROWS,
    TILES_GRAPH_MAX_ROWS,
    DecodeGraph,
    _with_head,
)
from sluice.engine.llm import LLM
from sluice.engine.model_runner import ModelRunner, SeqChunk
from sluice.engine.models.llama import TransformerBlock
from sluice.engine.native import NativeOps, native_ops
from sluice.engine.sampling_params import SamplingParams

from .test_quant import GREEDY_PROMPTS, PERPLEXITY_TEXT, first_difference, greedy, quantized

PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ",
           "Here are three tips for staying healthy:\n1.")


@pytest.fixture(scope="module")
def ops() -> NativeOps:
    built = native_ops("native", torch.device("cpu"), torch.float32)
    assert built is not None and built.q4_int8_path is not None
    if not built.q4_int8_path():
        pytest.skip("no AVX2 on this CPU: the graph keeps float activations")
    return built


def int8_reference(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """x @ W^T as the kernel computes it, in float64: per 32-block, v = x * 127 / absmax
    (float32), q1 = round(v), q2 = round(256 (v - q1)) (half to even), so x ~ dx (q1 +
    q2 / 256) with dx = absmax / 127; d * dx / 256 * (256 sum(q q1) + sum(q q2)) with the
    nibbles q, plus m (Q4_1) or -8 d (Q4_0) times the block's float sum of x; Q8_0: q the
    signed bytes, no m (the kernel's +128 offset on them comes back out exactly)."""
    raw = blocks.numpy()
    size = {2: 18, 3: 20, 8: 34}[ggml_type]
    n, nb = raw.shape[0], raw.shape[1] // size
    blk = raw.reshape(n, nb, size)
    d = blk[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = blk[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64) if ggml_type == 3 \
        else -8 * d if ggml_type == 2 else 0 * d
    if ggml_type == 8:
        q = blk[:, :, 2:].copy().view(np.int8).astype(np.float64)  # [n, nb, 32]
    else:
        qs = blk[:, :, size - 16:]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.float64)  # [n, nb, 32]
    xb = x.numpy().reshape(x.shape[0], nb, 32)
    amax = np.abs(xb).max(-1)
    dx = (amax / np.float32(127) / np.float32(256)).astype(np.float32).astype(np.float64)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    v = (xb * inv[..., None]).astype(np.float32)
    q1 = np.rint(v)
    q2 = np.clip(np.rint((v - q1) * np.float32(256)), -127, 127)
    dots = 256 * np.einsum("nbj,rbj->rnb", q, q1) + np.einsum("nbj,rbj->rnb", q, q2)
    xsum = xb.astype(np.float64).sum(-1)
    out = (d[None] * dx[:, None, :] * dots).sum(-1) + (m[None] * xsum[:, None, :]).sum(-1)
    return torch.from_numpy(out)


@pytest.mark.parametrize("ggml_type", [2, 3, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 11])
@pytest.mark.parametrize("cols", [96, 160, 576])  # 3 and 5 blocks: a group and a tail
def test_q4_int8_linear_matches_its_float64_reference(ops: NativeOps, ggml_type: int,
                                                      rows: int, cols: int) -> None:
    assert ops.gguf_linear_int8 is not None and ops.int8_activation_types is not None
    assert ops.q4_int8_path is not None
    if ggml_type not in ops.int8_activation_types():
        # Q8_0 needs vpdpbusd (AVX512-VNNI): the graph keeps its float activations
        assert ggml_type == 8 and ops.q4_int8_path() != "avx512_vnni"
        with pytest.raises(RuntimeError, match="int8_activation_types"):
            ops.gguf_linear_int8(torch.randn(1, 32), quantized(8, 1, 32, seed=0)[0], 8, None)
        return
    # 41 output rows: an odd one left after the pairs of weight rows a pass computes
    blocks, dense = quantized(ggml_type, 41, cols, seed=ggml_type * 1000 + rows * 10 + cols)
    torch.manual_seed(rows + cols)
    x, bias = torch.randn(rows, cols), torch.randn(41)
    x[0, :32] = 0  # an all-zero block: scale 0, no division by it
    got = ops.gguf_linear_int8(x, blocks, ggml_type, bias).double()
    want = int8_reference(x, blocks, ggml_type) + bias.double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # against float activations: two int8 vectors carry ~15 bits of each value
    exact = x.double() @ dense.T + bias.double()
    assert float((got - exact).abs().max()) < 1e-3 * float(exact.abs().max())


def runner(dtype: str, eager: bool) -> ModelRunner:
    return ModelRunner(EngineConfig.from_options(None, num_kv_blocks=64, quantization="gguf",
                                                 dtype=dtype, enforce_eager=eager))


@pytest.fixture(scope="module")
def pair() -> tuple[ModelRunner, ModelRunner]:
    """(torch model, graph on float activations), float32."""
    eager, graph = runner("float32", True), runner("float32", False)
    graph.decode_graph = DecodeGraph.build(graph.model, graph.gguf_blocks, graph.native,
                                           int8_activations=False)
    return eager, graph


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


def one_block_decodes(r: ModelRunner, rows: int) -> list[SeqChunk]:
    """`rows` sequences, each a short prompt prefilled into block i of its own (the last
    token varies), as the decode chunks of their next step."""
    base = r.tokenizer.encode("The capital of France is")
    assert len(base) + 2 <= r.block_size  # each sequence in one block of its own
    chunks = []
    for i in range(rows):
        ids = [*base, 100 + 7 * i]
        chunks.append(SeqChunk([prefill(r, ids, [i])], len(ids), [i], True))
    return chunks


def graph_execute(r: ModelRunner, chunks: list[SeqChunk],
                  graph: DecodeGraph | None = None) -> tuple[torch.Tensor, int]:
    """`r.execute(chunks)` and how many times it called `graph` (its decode graph)."""
    graph = graph or r.decode_graph
    assert graph is not None
    calls = []
    forward = graph.forward
    graph.forward = lambda *args: calls.append(1) or forward(*args)  # type: ignore
    try:
        return r.execute(chunks), len(calls)
    finally:
        del graph.forward  # type: ignore[method-assign]


@pytest.mark.model
def test_built_for_gguf_panels_or_bf16_and_not_when_eager(
        pair: tuple[ModelRunner, ModelRunner]) -> None:
    eager, graph = pair
    assert graph.decode_graph is not None and eager.decode_graph is None
    dense = ModelRunner(EngineConfig.from_options(None, num_kv_blocks=16, dtype="float32"))
    assert dense.panels and dense.decode_graph is not None  # float32: on panels
    bf16 = ModelRunner(EngineConfig.from_options(None, num_kv_blocks=16, dtype="bfloat16"))
    assert bf16.native is not None and bf16.native.bf16_linear_path is not None
    assert not bf16.panels
    # on AMX tiles or AVX512-BF16
    assert (bf16.decode_graph is not None) == bool(bf16.native.bf16_linear_path())
    eager_bf16 = ModelRunner(EngineConfig.from_options(None, num_kv_blocks=16, dtype="bfloat16",
                                                       enforce_eager=True))
    assert eager_bf16.decode_graph is None


@pytest.mark.model
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
    got, calls = graph_execute(graph, chunks)
    want = eager.execute(chunks)
    assert calls == 1 and got.shape == want.shape == (5, graph.vocab_size)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * float(want.abs().max()))
    assert (got.argmax(-1) == want.argmax(-1)).all()
    bs = graph.block_size
    slots = [ta[len(a) // bs] * bs + len(a) % bs, tc[len(c) // bs] * bs + len(c) % bs] + [
        tb[p // bs] * bs + p % bs for p in range(len(b), len(b) + 3)]
    torch.testing.assert_close(pool_rows(graph, slots), pool_rows(eager, slots),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.model
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


@pytest.mark.model
def test_steps_it_takes(pair: tuple[ModelRunner, ModelRunner]) -> None:
    graph = pair[1].decode_graph
    assert graph is not None
    table = list(range(8))
    decode = SeqChunk([1], 20, table, True)
    assert graph.takes([decode] * GRAPH_MAX_ROWS)
    assert not graph.takes([decode] * (GRAPH_MAX_ROWS + 1))  # the dense weights' batch
    assert graph.takes([SeqChunk([1, 2, 3], 20, table, True, num_logits=3)])
    assert not graph.takes([decode, SeqChunk([1, 2], 20, table, True)])  # a prefill


@pytest.mark.model
def test_steps_past_the_gguf_graph_take_the_dense_graph(
        pair: tuple[ModelRunner, ModelRunner]) -> None:
    """float32 + GGUF: 8 rows on the blocks, 9 and more on the dense weights' graph (the
    panels), which agrees with the torch model on those weights."""
    eager, graph = pair
    wide = graph.wide_graph
    assert wide is not None and eager.wide_graph is None
    ids = eager.tokenizer.encode(PROMPTS[0])
    tables = [list(range(2 * i, 2 * i + 2)) for i in range(GRAPH_MAX_ROWS + 2)]
    firsts = [prefill(eager, ids, t) for t in tables]
    assert [prefill(graph, ids, t) for t in tables] == firsts
    chunks = [SeqChunk([f], len(ids), t, True) for f, t in zip(firsts, tables, strict=True)]
    got, calls = graph_execute(graph, chunks, wide)
    want = eager.execute(chunks)
    assert calls == 1 and got.shape == want.shape == (GRAPH_MAX_ROWS + 2, graph.vocab_size)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))


@pytest.mark.model
def test_a_rows_logits_do_not_depend_on_its_steps_size(ops: NativeOps) -> None:
    """The default GGUF graph (int8 activations) takes steps of up to 64 rows on the
    column tiles (AVX512-VNNI), 8 elsewhere. On the tiles it computes every row alike: a
    sequence's logits in a step of 64 rows equal, bit for bit, its logits alone, so
    greedy outputs do not depend on what shares a step (speculation included). The row
    layout (AVX2, AVX-512BW) sums one or two rows of a pass in another order than three
    or four, so there the rows agree only closely."""
    r = runner("float32", False)
    graph = r.decode_graph
    assert graph is not None and ops.q4_int8_path is not None
    tiles = ops.q4_int8_path() == "avx512_vnni"
    assert graph.max_rows == (TILES_GRAPH_MAX_ROWS if tiles else GRAPH_MAX_ROWS)
    rows = graph.max_rows
    chunks = one_block_decodes(r, rows)
    together, calls = graph_execute(r, chunks)
    assert calls == 1 and together.shape == (rows, r.vocab_size)
    for i in (0, 1, rows // 2, rows - 1):
        alone, calls = graph_execute(r, [chunks[i]])
        assert calls == 1
        if tiles:
            assert torch.equal(alone[0], together[i]), i
        else:
            torch.testing.assert_close(alone[0], together[i], rtol=0,
                                       atol=1e-3 * float(alone.abs().max()))


def test_the_dense_graph_takes_the_gguf_head_where_the_gguf_graph_does(ops: NativeOps) -> None:
    """The LM head of the dense graph (steps past the GGUF graph's rows) runs on the GGUF
    blocks on int8 activations wherever the GGUF graph's does (Q8_0 with VNNI), so a
    sequence's logits come from one head kernel whatever its step's size; elsewhere it
    stays on the panels."""
    assert ops.int8_activation_types is not None
    blocks = quantized(8, 16, 64, seed=3)[0]
    dense = [torch.zeros(16, 64)] * 2, [F32] * 2, [False] * 2, [torch.zeros(2, 64, 16)] * 2
    weights, types, int8, panels = _with_head(ops, (blocks, 8), *dense)
    if 8 in ops.int8_activation_types():
        assert weights[-1] is blocks and types == [F32, 8] and int8 == [False, True]
        assert panels[-1].numel() == 0 and weights[0] is dense[0][0]
    else:
        assert (weights, types, int8, panels) == dense
    assert _with_head(ops, None, *dense) == dense
    assert _with_head(ops, (quantized(3, 16, 64, seed=4)[0], 3), *dense)[1] == \
        ([F32, 3] if 3 in ops.int8_activation_types() else [F32] * 2)


@pytest.mark.model
def test_lora_takes_the_graph() -> None:
    """With adapters enabled decodes still take the graph, which adds each row's adapter
    (tests/engine/test_lora.py::test_the_decode_graph_adds_each_rows_adapter)."""
    lora = ModelRunner(EngineConfig.from_options(None, num_kv_blocks=16, quantization="gguf",
                                                 enable_lora=True))
    assert lora.decode_graph is not None


@pytest.mark.model
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
        runner = llm.engine.runner
        if not eager:  # float activations, as the torch model's
            runner.decode_graph = DecodeGraph.build(runner.model, runner.gguf_blocks,
                                                    runner.native, int8_activations=False)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(list(PROMPTS), params)]
    if dtype == "float32":
        assert outs[True] == outs[False]
    else:
        agree = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                 for x, y in zip(outs[True], outs[False], strict=True)]
        print("bfloat16: greedy tokens agreeing before the first difference:", agree)
        assert min(agree) >= 4 and sum(agree) >= 0.5 * 32 * len(PROMPTS)


@pytest.mark.model
def test_int8_activations_keep_perplexity_and_greedy_tokens(ops: NativeOps) -> None:
    """The default graph (int8 activations) against the dequantized float32 model: the
    text's perplexity within 1%, teacher-forced 8 tokens a step (verify rows: each sees
    the K/V the rows before it wrote); greedy agreement printed, loosely bounded."""
    reference = ModelRunner(EngineConfig.from_options(None, num_kv_blocks=64, dtype="float32"))
    graph = runner("float32", False)
    assert graph.decode_graph is not None
    ids = graph.tokenizer.encode(PERPLEXITY_TEXT)
    table = list(range(0, -(-len(ids) // graph.block_size)))
    want = reference.execute([SeqChunk(ids, 0, table, True, num_logits=len(ids))])
    rows = [graph.execute([SeqChunk(ids[i:i + GRAPH_MAX_ROWS], i, table, True,
                                    num_logits=len(ids[i:i + GRAPH_MAX_ROWS]))])
            for i in range(0, len(ids), GRAPH_MAX_ROWS)]
    got = torch.cat(rows)
    target = torch.tensor(ids[1:])
    ppl_ref = math.exp(float(F.cross_entropy(want[:-1], target)))
    ppl = math.exp(float(F.cross_entropy(got[:-1], target)))
    top1 = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    print(f"perplexity: dequantized {ppl_ref:.4f}, graph int8 {ppl:.4f}; top-1 {top1:.3f}")
    assert abs(ppl / ppl_ref - 1) < 0.01 and top1 > 0.9
    agree = [first_difference(greedy(reference, graph.tokenizer.encode(p), 24, 8 * i),
                              greedy(graph, graph.tokenizer.encode(p), 24, 8 * i))
             for i, p in enumerate(GREEDY_PROMPTS)]
    print("greedy tokens agreeing before the first difference:", agree)
    assert sum(agree) >= 0.5 * 24 * len(GREEDY_PROMPTS)


@pytest.mark.model
def test_speculative_verifies_stay_in_the_graph(default_gguf: Path) -> None:
    """One stream drafting up to 8 tokens: each draft is cut to the graph's 8 rows (7
    drafts and the last token), so every decode and verify step runs as the graph and
    the greedy tokens are plain decoding's (past the graph's rows the torch model would
    compute the rows, rounding differently)."""
    llm = LLM(str(default_gguf), quantization="gguf", num_kv_blocks=64, max_num_seqs=1,
              speculative_config={"method": "ngram", "num_speculative_tokens": 8,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 5,
                                  "adaptive": False})  # drafts whatever it finds: no timing
    graph, core = llm.engine.runner.decode_graph, llm.engine.core
    assert graph is not None and core.spec is not None
    takes, left_out = graph.takes, []

    def spy(chunks: list[SeqChunk]) -> bool:
        taken = takes(chunks)
        if not taken and all(c.one_query_rows for c in chunks):
            left_out.append(sum(len(c.token_ids) for c in chunks))
        return taken

    graph.takes = spy  # type: ignore[method-assign]
    text = PERPLEXITY_TEXT[:400]
    prompt = f"Copy this text exactly.\n\n{text}\n\nCopy:\n{text[:60]}"
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    spec = core.spec
    drafted = llm.generate([prompt], params)[0].outputs[0].token_ids
    core.spec = None
    plain = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert spec.num_draft_tokens >= 8 and spec.num_accepted_tokens > 0
    assert left_out == []
    assert drafted == plain


def decodes_and_verifies(eager: ModelRunner, graph: ModelRunner,
                         copies: int) -> tuple[list[SeqChunk], list[int]]:
    """`copies` x two prompts prefilled in both runners (the same first token), then a
    step of chunks: the first prompt's decode, the second's 3-token verify (4 rows a
    copy); and the KV slots those rows write."""
    bs = graph.block_size
    chunks, slots = [], []
    for i in range(copies):
        for j, prompt in enumerate(PROMPTS[:2]):
            ids = eager.tokenizer.encode(f"{i}. {prompt}")
            table = list(range(2 * (2 * i + j), 2 * (2 * i + j) + 2))
            first = prefill(eager, ids, table)
            assert prefill(graph, ids, table) == first
            tokens = [first] if j == 0 else [first, 11, 12]
            chunks.append(SeqChunk(tokens, len(ids), table, True, num_logits=len(tokens)))
            slots += [table[p // bs] * bs + p % bs for p in range(len(ids), len(ids) + len(tokens))]
    return chunks, slots


# -- float32 on panels -----------------------------------------------------------------
@pytest.fixture(scope="module")
def float_pair() -> tuple[ModelRunner, ModelRunner]:
    """(torch model, graph), float32 on panels."""
    pair = tuple(ModelRunner(EngineConfig.from_options(None, num_kv_blocks=64, dtype="float32",
                                                       enforce_eager=eager))
                 for eager in (True, False))
    assert all(r.panels for r in pair)
    return pair  # type: ignore[return-value]


@pytest.mark.model
@pytest.mark.parametrize("copies", [1, 13])  # 3 and 39 rows: the GEMV, then the panels
def test_float_graph_decodes_match_the_torch_model(
        float_pair: tuple[ModelRunner, ModelRunner], copies: int) -> None:
    """Sequences at different lengths, then one step of their decodes and a 3-token
    verify each: logits and the K/V rows written agree with the torch model's."""
    eager, graph = float_pair
    assert graph.decode_graph is not None and eager.decode_graph is None
    chunks, slots = decodes_and_verifies(eager, graph, copies)
    got, calls = graph_execute(graph, chunks)
    want = eager.execute(chunks)
    assert calls == 1 and got.shape == want.shape == (4 * copies, graph.vocab_size)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))
    assert (got.argmax(-1) == want.argmax(-1)).all()
    torch.testing.assert_close(pool_rows(graph, slots), pool_rows(eager, slots),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.model
def test_float_graph_takes_every_decode_step(float_pair: tuple[ModelRunner, ModelRunner]) -> None:
    graph = float_pair[1].decode_graph
    assert graph is not None
    decode = SeqChunk([1], 20, list(range(8)), True)
    assert graph.takes([decode] * 256)
    assert not graph.takes([decode, SeqChunk([1, 2], 20, list(range(8)), True)])  # a prefill


@pytest.mark.model
def test_float_graph_greedy_generation_matches_the_torch_model() -> None:
    """Whole requests through the engine, six at a time: the same greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [f"{i}. {p}" for i in range(2) for p in PROMPTS]
    outs = {}
    for eager in (True, False):
        llm = LLM(dtype="float32", enforce_eager=eager, num_kv_blocks=64, max_num_seqs=6)
        assert (llm.engine.runner.decode_graph is None) == eager
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]


# -- bfloat16 on AMX -------------------------------------------------------------------

def bf16_runner() -> ModelRunner:
    """A bfloat16 runner on the default model with its decode graph; the test is skipped
    where this CPU has no native bfloat16 linears."""
    r = ModelRunner(EngineConfig.from_options(None, num_kv_blocks=64, dtype="bfloat16"))
    if r.decode_graph is None:
        ops = r.native
        assert ops is not None and ops.bf16_linear_path is not None
        assert not ops.bf16_linear_path()
        pytest.skip("no bfloat16 graph here: it needs AMX (amx_bf16, amx_tile) or avx512_bf16")
    return r

@pytest.mark.model
def test_bf16_graph_decodes_agree_with_the_torch_model() -> None:
    """Sequences at different lengths, then one step of their decodes and a 3-token verify
    each, 40 rows: the graph (float32 activations, each linear's input rounded to
    bfloat16, AMX tiles or AVX512-BF16) against the bfloat16 torch model (every op's output rounded):
    logits within bfloat16's rounding, the same greedy token on nearly every row, and the
    K/V rows written close (the two round at different places, so deep layers drift)."""
    graph = bf16_runner()
    eager = ModelRunner(EngineConfig.from_options(None, num_kv_blocks=64, dtype="bfloat16",
                                                  enforce_eager=True))
    chunks, slots = decodes_and_verifies(eager, graph, 10)
    got, calls = graph_execute(graph, chunks)
    want = eager.execute(chunks).float()
    assert calls == 1 and got.shape == want.shape == (40, graph.vocab_size)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    kv_got, kv_want = pool_rows(graph, slots).float(), pool_rows(eager, slots).float()
    assert (kv_got - kv_want).abs().max() < 0.05 * kv_want.abs().max()
    assert (kv_got - kv_want).abs().mean() < 0.01 * kv_want.abs().mean()


@pytest.mark.model
def test_bf16_graph_rows_do_not_depend_on_the_steps_size() -> None:
    """A row's logits in a 40-row step (on AMX a pass of 2 row blocks, then one of 1; on
    AVX512-BF16 4 blocks of 10; the attention taking whole rows) equal, bit for bit, its
    logits alone: each output's sum runs over the inputs in the same order whatever the
    step's rows, so greedy tokens and speculation's verifies do not depend on what shares
    a graph step."""
    r = bf16_runner()
    chunks = one_block_decodes(r, 40)
    together, calls = graph_execute(r, chunks)
    assert calls == 1 and together.shape == (40, r.vocab_size)
    for i in (0, 1, 17, 39):
        alone, calls = graph_execute(r, [chunks[i]])
        assert calls == 1 and torch.equal(alone[0], together[i]), i
    assert not torch.equal(together[0], together[1])  # the rows differ


@pytest.mark.model
def test_bf16_prompt_logits_are_float32_and_pick_as_a_decode_step_does() -> None:
    """A bfloat16 model's prompt logits come from its head in float32 (`FloatHead`, the
    decode graph's packed head). Through oneDNN they were rounded to bfloat16, 0.125
    apart at these logits' size: "The" and "L", 0.08 apart for this prompt, tied and the
    lower id won, where a decode step (the graph, float32 logits) picks "The"; so the
    same prompt answered "L'Étoile, ..." uncached and "The capital of France is Paris."
    with its prefix cached (its last token then runs as a one-token step)."""
    r = bf16_runner()
    text = r.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])
    ids = r.tokenizer.encode(text)
    n = -(-len(ids) // r.block_size)
    whole = r.execute([SeqChunk(ids, 0, list(range(n)), True)])[0]
    assert whole.dtype == torch.float32
    assert not torch.equal(whole, whole.bfloat16().float())  # not rounded to bfloat16
    table = list(range(n, 2 * n))
    r.execute([SeqChunk(ids[:-1], 0, table, False)])  # the prefix, then its last token
    last, calls = graph_execute(r, [SeqChunk(ids[-1:], len(ids) - 1, table, True)])
    assert calls == 1
    assert int(whole.argmax()) == int(last[0].argmax())
    assert r.tokenizer.decode([int(whole.argmax())]) == "The"
    assert (whole - last[0]).abs().max() < 0.05 * last[0].abs().max()
