"""Multi-LoRA in the engine, on the tiny random Llama with adapters made by peft.

- An adapter's outputs equal the base model with the adapter merged (peft's
  `merge_and_unload`, loaded by sluice as a plain checkpoint).
- A mixed batch (base + 4 adapters of different ranks, targets and scalings) gives
  each request exactly its single-adapter output; so does one with `max_loras=2` (the
  scheduler holds back the third adapter until a slot frees).
- The prefix cache is keyed by the adapter's content: the same weights under another
  name hit it, another adapter (or the base) does not; KV events carry the adapter.
- A broken adapter is refused with a 400 naming the problem; the engine keeps serving.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lora_adapters import ALL_TARGETS, make_adapter, merge_adapter
from sluice.engine.llm import LLM
from sluice.engine.lora import LoRARequest, read_adapter
from sluice.engine.sampling_params import SamplingParams
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.kv_events import BlockStored

BASE_OPTIONS = dict(dtype="float32", num_kv_blocks=256, block_size=16, max_model_len=512,
                    max_num_seqs=32,
                    max_num_batched_tokens=512)
LORA_OPTIONS = dict(BASE_OPTIONS, enable_lora=True, max_loras=4, max_lora_rank=16)
SPECS: dict[str, dict] = {
    "all-r8": dict(r=8, alpha=16, targets=ALL_TARGETS, seed=1),
    "qv-r4": dict(r=4, alpha=8, targets=("q_proj", "v_proj"), seed=2),
    "mlp-o-r16-rslora": dict(r=16, alpha=8, targets=("o_proj", "gate_proj", "up_proj",
                                                     "down_proj"), rslora=True, seed=3),
    "all-r2": dict(r=2, alpha=4, targets=ALL_TARGETS, seed=4),
}
PROMPTS = [[1, 500, 23, 9000, 77], [1, 42, 4242, 12, 7, 99, 3000, 15, 8, 31000],
           [1, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(tiny_llama_dir, root / name, **spec)
            for name, spec in SPECS.items()}


@pytest.fixture(scope="module")
def lora_llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), **LORA_OPTIONS)


def _lora(name: str, path: Path) -> LoRARequest:
    return LoRARequest(name, str(path))


def _run(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]
         ) -> list[tuple[list[int], float]]:
    outs = llm.generate(prompts, GREEDY, lora_request=loras)
    return [(list(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob or 0.0) for o in outs]


@pytest.fixture(scope="module")
def singles(lora_llm: LLM, adapters: dict[str, Path]) -> dict[str | None, list]:
    """Each adapter (and the base) alone, one generate call each."""
    out: dict[str | None, list] = {None: _run(lora_llm, PROMPTS, [None] * len(PROMPTS))}
    for name, path in adapters.items():
        out[name] = _run(lora_llm, PROMPTS, [_lora(name, path)] * len(PROMPTS))
    return out


def test_adapter_equals_merged_model(tiny_llama_dir: Path, adapters: dict[str, Path],
                                     singles: dict[str | None, list],
                                     tmp_path: Path) -> None:
    for name, path in adapters.items():
        merged_dir = merge_adapter(tiny_llama_dir, path, tmp_path / f"merged-{name}")
        merged = _run(LLM(str(merged_dir), **BASE_OPTIONS), PROMPTS, [None] * len(PROMPTS))
        got = singles[name]
        assert [t for t, _ in got] == [t for t, _ in merged], name
        for (_, lp_got), (_, lp_ref) in zip(got, merged, strict=True):
            assert lp_got == pytest.approx(lp_ref, abs=1e-3), name
        # the adapter does change the model (else the test would prove nothing)
        assert [t for t, _ in got] != [t for t, _ in singles[None]], name


def test_mixed_batch_gives_each_request_its_single_adapter_output(
        lora_llm: LLM, adapters: dict[str, Path], singles: dict[str | None, list]) -> None:
    names: list[str | None] = [None, *adapters]
    prompts, loras, want = [], [], []
    for i, prompt in enumerate(PROMPTS):  # interleaved: every step mixes all five
        for name in names:
            prompts.append(prompt)
            loras.append(None if name is None else _lora(name, adapters[name]))
            want.append(singles[name][i][0])
    got = _run(lora_llm, prompts, loras)
    assert [t for t, _ in got] == want


def test_max_loras_limits_adapters_per_batch(tiny_llama_dir: Path, adapters: dict[str, Path],
                                             singles: dict[str | None, list]) -> None:
    llm = LLM(str(tiny_llama_dir), **dict(LORA_OPTIONS, max_loras=2, max_cpu_loras=2))
    engine = llm.engine
    expected: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        for name in [None, *adapters]:
            rid = f"{name}-{i}"
            lora = None if name is None else _lora(name, adapters[name])
            engine.add_request(rid, prompt, GREEDY, lora_request=lora)
            expected[rid] = singles[name][i][0]
    got: dict[str, list[int]] = {}
    most = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = list(out.outputs[0].token_ids)
        running = engine.stats().running_lora_adapters
        most = max(most, len(running.split(",")) if running else 0)
    assert got == expected
    assert most == 2  # never more adapters in a batch than slots, and the slots were used
    assert engine.runner.lora_slots is not None and engine.runner.lora_slots.loads >= 4


def test_prefix_cache_keyed_by_adapter_content(lora_llm: LLM, adapters: dict[str, Path],
                                               tmp_path: Path) -> None:
    engine = lora_llm.engine
    engine.drain_kv_events()
    prompt = list(range(1000, 1040))  # two full blocks and a partial one
    copy = shutil.copytree(adapters["all-r8"], tmp_path / "same-weights")
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def hits_of(lora: LoRARequest | None) -> int:
        before = engine.stats().prefix_cache_hits
        lora_llm.generate([prompt], params, lora_request=lora)
        return engine.stats().prefix_cache_hits - before

    assert hits_of(_lora("all-r8", adapters["all-r8"])) == 0
    assert hits_of(LoRARequest("renamed", str(copy))) == 32  # same weights, other name
    assert hits_of(_lora("all-r2", adapters["all-r2"])) == 0  # other weights
    assert hits_of(None) == 0  # the base model
    assert hits_of(None) == 32
    stored = [e for e in engine.drain_kv_events() if isinstance(e, BlockStored)]
    first_hashes = {e.block_hashes[0] for e in stored if e.token_ids[:16] == prompt[:16]}
    assert len(first_hashes) == 3  # all-r8 (and its copy), all-r2, base
    lora_ids = {e.lora_id for e in stored}
    assert None in lora_ids and len(lora_ids) == 3


def _write_adapter(path: Path, config: dict, tensors: dict) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def test_broken_adapters_are_refused_and_the_engine_keeps_serving(
        lora_llm: LLM, tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path,
        singles: dict[str | None, list]) -> None:
    import torch

    high_rank = make_adapter(tiny_llama_dir, tmp_path / "r32", r=32, alpha=32, seed=5)
    no_weights = shutil.copytree(adapters["qv-r4"], tmp_path / "no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    wrong_base = _write_adapter(tmp_path / "wrong-base", config, {
        key.format("A"): torch.zeros(4, 32), key.format("B"): torch.zeros(64, 4)})
    embed = _write_adapter(tmp_path / "embed", dict(config, target_modules=["embed_tokens"]),
                           {key.format("A"): torch.zeros(4, 64),
                            key.format("B"): torch.zeros(64, 4)})
    cases = {
        high_rank: "LoRA rank 32 is greater than max_lora_rank 16",
        tmp_path / "missing": "does not exist",
        no_weights: "has no adapter_model.safetensors",
        wrong_base: "an adapter for another base model",
        embed: "expected target modules",
    }
    for path, message in cases.items():
        with pytest.raises(InvalidRequestError, match=message) as info:
            lora_llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("bad", str(path)))
        assert info.value.param == "lora_path"
    # still serving, base and adapters alike
    assert _run(lora_llm, PROMPTS, [None] * 3) == singles[None]
    lora = _lora("qv-r4", adapters["qv-r4"])
    assert [t for t, _ in _run(lora_llm, PROMPTS, [lora] * 3)] == \
        [t for t, _ in singles["qv-r4"]]


def test_read_adapter_reports_meta(adapters: dict[str, Path]) -> None:
    from sluice.engine.lora import module_shapes

    shapes = module_shapes(64, 128, 64, 32)
    meta, _ = read_adapter(str(adapters["mlp-o-r16-rslora"]), shapes, 2, 16)
    assert meta.rank == 16 and meta.scaling == pytest.approx(8 / 4)
    assert meta.target_modules == ("down_proj", "gate_proj", "o_proj", "up_proj")
    other, _ = read_adapter(str(adapters["all-r8"]), shapes, 2, 16)
    assert other.content_hash != meta.content_hash and len(other.content_hash) == 64


def test_fused_modules_are_read_as_their_parts(tmp_path: Path) -> None:
    """A fused qkv_proj (Phi-3's) is its parts' adapter: one A, B of q|k|v's outputs;
    a fused module beside one of its parts in a layer is refused naming both."""
    import torch
    from safetensors.torch import save_file

    from sluice.engine.lora import load_adapter, module_shapes

    shapes = module_shapes(64, 128, 64, 32)
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 2, "target_modules": ["qkv_proj"]}))
    prefix = "base_model.model.model.layers.0.self_attn"
    a, b = torch.randn(2, 64), torch.randn(64 + 32 + 32, 2)
    tensors = {f"{prefix}.qkv_proj.lora_A.weight": a, f"{prefix}.qkv_proj.lora_B.weight": b}
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    adapter = load_adapter(str(tmp_path), shapes, 2, 8)
    assert adapter.meta.target_modules == ("k_proj", "q_proj", "v_proj")
    for module, rows in (("q_proj", b[:64]), ("k_proj", b[64:96]), ("v_proj", b[96:])):
        assert torch.equal(adapter.weights[(0, module)][0], a)
        assert torch.equal(adapter.weights[(0, module)][1], rows)
    tensors |= {f"{prefix}.k_proj.lora_A.weight": torch.zeros(2, 64),
                f"{prefix}.k_proj.lora_B.weight": torch.zeros(32, 2)}
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(InvalidRequestError) as err:
        read_adapter(str(tmp_path), shapes, 2, 8)
    assert err.value.param == "lora_path"
    assert "both k_proj and qkv_proj for k_proj" in str(err.value)


def test_lora_requests_need_enable_lora(tiny_llama_dir: Path, adapters: dict[str, Path]
                                        ) -> None:
    llm = LLM(str(tiny_llama_dir), **BASE_OPTIONS)
    with pytest.raises(InvalidRequestError, match="--enable-lora") as info:
        llm.generate(PROMPTS[:1], GREEDY,
                     lora_request=_lora("all-r8", adapters["all-r8"]))
    assert info.value.param == "model"


def test_lora_fields_cross_the_process_pipe() -> None:
    from sluice.engine.messages import Add, CoreInfo, CoreRequest, Ready, decode, encode

    lora = LoRARequest("sql", "/adapters/sql", "ab" * 32)
    add = decode(encode(Add(CoreRequest("r1", [1, 2, 3], GREEDY, lora=lora))))
    assert isinstance(add, Add) and add.request.lora == lora
    assert decode(encode(Add(CoreRequest("r2", [1], GREEDY)))).request.lora is None  # type: ignore[union-attr]
    info = CoreInfo("m", 512, 100, 64, 16, "auto", True, 4, 16, 2, {"q_proj": [64, 64]})
    ready = decode(encode(Ready(info)))
    assert isinstance(ready, Ready) and ready.info == info


def test_mixed_batch_on_the_torch_path(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    """Without the native kernels the decode rows take the masked all-slots products."""
    llm = LLM(str(tiny_llama_dir), **dict(LORA_OPTIONS, kernel_backend="torch"))
    assert llm.engine.runner.lora_slots is not None
    assert llm.engine.runner.lora_slots.step.kernel is None
    names: list[str | None] = [None, "all-r8", "qv-r4"]
    alone = {n: _run(llm, PROMPTS, [None if n is None else _lora(n, adapters[n])] * 3)
             for n in names}
    prompts = [p for p in PROMPTS for _ in names]
    loras = [None if n is None else _lora(n, adapters[n]) for _ in PROMPTS for n in names]
    got = _run(llm, prompts, loras)
    want = [alone[n][i][0] for i in range(len(PROMPTS)) for n in names]
    assert [t for t, _ in got] == want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decode_graph_adds_each_rows_adapter(tiny_llama_dir: Path,
                                                  adapters: dict[str, Path], dtype: str) -> None:
    """Decode steps with adapter rows take the native decode graph, each row adding its
    own slot's products (lora_bgmv's, float32 rows against the adapters in the model's
    dtype): two adapters, the base and an adapter's 3-token verify in one step give the
    torch model's logits; the adapters change them."""
    import torch

    from sluice.engine.config import EngineConfig
    from sluice.engine.model_runner import ModelRunner, SeqChunk

    eager, graph = (ModelRunner(EngineConfig.from_options(
        str(tiny_llama_dir), num_kv_blocks=64, block_size=16, dtype=dtype, enable_lora=True,
        max_loras=4, max_lora_rank=16, enforce_eager=e)) for e in (True, False))
    if graph.decode_graph is None:
        assert dtype == "bfloat16"
        pytest.skip("no bfloat16 decode graph on this CPU (needs AMX or AVX512-BF16)")
    a, b = (eager.load_lora(str(adapters[n]), 16) for n in ("all-r8", "mlp-o-r16-rslora"))
    loras = [a, b, None, a]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(4)]
    for runner in (eager, graph):  # the prompts (the torch model in both)
        runner.execute([SeqChunk(p, 0, t, True, lora) for p, t, lora
                        in zip(PROMPTS + PROMPTS[:1], tables, loras, strict=True)])

    def step(runner: ModelRunner, adapters: list) -> torch.Tensor:
        chunks = [SeqChunk([11], len(p), t, True, lora) for p, t, lora
                  in zip(PROMPTS, tables[:3], adapters[:3], strict=True)]
        chunks.append(SeqChunk([11, 12, 13], len(PROMPTS[0]), tables[3], True, adapters[3],
                               num_logits=3))
        return runner.execute(chunks)

    calls = []
    graph_execute = graph.decode_graph.execute

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return graph_execute(*args)  # type: ignore[arg-type]

    graph.decode_graph.execute = counted  # type: ignore[method-assign]
    want, got = step(eager, loras), step(graph, loras)
    assert calls == [1] and got.shape == want.shape == (6, graph.vocab_size)
    tol = 1e-4 if dtype == "float32" else 0.05
    assert float((got - want).abs().max()) <= tol * float(want.abs().max())
    base = step(graph, [None] * 4)  # (writes the same K/V rows again)
    assert not torch.allclose(got[[0, 1, 3]], base[[0, 1, 3]], atol=1e-2)
    torch.testing.assert_close(got[2], base[2], rtol=0, atol=0)  # the base row: no LoRA
