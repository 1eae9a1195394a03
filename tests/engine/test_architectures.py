"""Architectures beyond Llama. Qwen3 (`Qwen3ForCausalLM`: an RMSNorm over each Q and K
head before RoPE, and heads wider than hidden / heads), SmolLM3 (`SmolLM3ForCausalLM`:
no RoPE in every fourth layer) and Granite (`GraniteForCausalLM`: multipliers folded into
the weights). Greedy tokens against transformers are in test_hf_equivalence.py and
test_model_runner.py (the tiny checkpoints are among their architectures); here: the
decode graph on each architecture's block, a llama.cpp `qwen3` GGUF file (float and Q8_0
blocks, the GGUF graph), a base-model checkpoint as Qwen3-Embedding ships (no `model.`
prefix, no LM head) read for embeddings, a LoRA adapter on Granite, Phi-3's fused
tensors, and the mixtures of experts (Mixtral, Qwen2/3-MoE, OLMoE; greedy tokens of
Granite MoE too are in test_hf_equivalence.py): their configs, the expert grouping
against a token-by-token sum, their GGUF files, what is refused, bfloat16, verify steps;
Gemma 3's config as the hub and transformers 5 write it, what is refused, bfloat16."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from lora_adapters import make_adapter, merge_adapter
from sluice.engine.config import EngineConfig
from sluice.engine.llm import LLM
from sluice.engine.lora import LoRARequest
from sluice.engine.model_runner import ModelRunner, SeqChunk
from sluice.engine.models.gguf_file import GGUFFile
from sluice.engine.models.gguf_loader import config_from_gguf, load_gguf_model
from sluice.engine.models.llama import BLOCK_NORMS
from sluice.engine.sampling_params import SamplingParams
from tiny_models import add_yarn, write_gguf

PROMPT = "The quick brown fox jumps over the lazy dog, and then it rests."


def hf_model(directory: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def decode_logits(runner: ModelRunner, ids: list[int], steps: int,
                  forced: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """The prompt, then `steps` greedy one-token steps (of the `forced` tokens, given):
    the tokens and their logits."""
    table = list(range(-(-(len(ids) + steps) // runner.block_size)))
    out = runner.execute([SeqChunk(ids, 0, table, True)])
    seq, logits = list(ids), [out[0].float()]
    for i in range(steps):
        seq.append(int(out[0].argmax()) if forced is None else forced[i])
        out = runner.execute([SeqChunk(seq[-1:], len(seq) - 1, table, True)])
        logits.append(out[0].float())
    return seq[len(ids):], torch.stack(logits)


def gguf_and_checkpoint_logits(path: Path, hf_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The GGUF file's logits for PROMPT and 3 greedy decode steps (the checkpoint's
    tokenizer), and transformers' on the checkpoint for the same tokens."""
    runner = ModelRunner(EngineConfig.from_options(str(path), tokenizer=str(hf_dir),
                                                   num_kv_blocks=64, block_size=4,
                                                   dtype="float32"))
    ids = runner.tokenizer.encode(PROMPT)
    tokens, got = decode_logits(runner, ids, 3)
    with torch.no_grad():
        want = hf_model(hf_dir)(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:]
    return got, want


@pytest.mark.parametrize("arch", ["qwen3", "smollm3", "gemma3", "gemma2", "olmo2", "olmo3",
                                  "exaone4", "glm4", "arcee", "granite4", "phi3_longrope"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_graph_runs_the_architecture(request: pytest.FixtureRequest, arch: str,
                                            dtype: str) -> None:
    """The native decode graph (float32 panels, or bfloat16 where the CPU has native
    bfloat16 linears) runs each architecture's block as the torch model does: Q/K norms
    of each head (Qwen3) or of all heads (OLMo 2), NoPE layers (SmolLM3, EXAONE 4's
    global ones), the branches' output norms with or without input norms (Gemma 3, OLMo 2,
    GLM-4-0414), GELU and relu² MLPs (Gemma, Arcee), sliding windows and their own RoPE
    (Gemma 3, OLMo 3), capped attention scores and logits (Gemma 2), partial rotation
    (GLM-4, Phi-4-mini-like longrope)."""
    directory: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    eager, graph = (ModelRunner(EngineConfig.from_options(
        str(directory), num_kv_blocks=64, block_size=4, dtype=dtype, enforce_eager=e))
        for e in (True, False))
    if graph.decode_graph is None:
        assert dtype == "bfloat16"
        pytest.skip("no bfloat16 decode graph on this CPU (needs AMX or AVX512-BF16)")
    ids = eager.tokenizer.encode(PROMPT)
    want_tokens, want = decode_logits(eager, ids, 6)
    if dtype == "float32":
        got_tokens, got = decode_logits(graph, ids, 6)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
        assert got_tokens == want_tokens
    else:  # the torch model's tokens (a random model's near ties go either way in bfloat16)
        _, got = decode_logits(graph, ids, 6, want_tokens)
        assert (got - want).abs().max() <= 0.05 * want.abs().max()
    # what each runs beyond a Llama's block (a sliding window shorter than the context)
    cfg, model, context = graph.model.cfg, graph.model, len(ids) + 6
    window = cfg.window(0) is not None and cfg.window(0) < context
    q_norm = model.layers[0].attention.q_norm
    assert {
        "qwen3": cfg.qk_norm and q_norm is not None and not torch.all(q_norm.weight == 1),
        "smollm3": [cfg.uses_rope(i) for i in (0, 1)] == [True, False],
        "gemma3": (cfg.block_norms == BLOCK_NORMS["gemma"] and cfg.mlp_activation == "gelu_tanh"
                   and cfg.qk_norm and window and model.local_rope is not None),
        "gemma2": (cfg.gemma is not None and cfg.gemma.attn_softcap is not None
                   and cfg.gemma.final_softcap is not None and window),
        "olmo2": cfg.block_norms == BLOCK_NORMS["olmo2"] and cfg.qk_norm_whole,
        "olmo3": (cfg.block_norms == BLOCK_NORMS["olmo2"] and cfg.qk_norm_whole and window
                  and model.local_rope is not None and cfg.rope.rope_type == "yarn"),
        "exaone4": (cfg.block_norms == BLOCK_NORMS["olmo2"] and cfg.qk_norm and window
                    and not cfg.uses_rope(1)),
        "glm4": cfg.block_norms == BLOCK_NORMS["glm4"] and cfg.rotary_dim < cfg.head_dim,
        "arcee": cfg.mlp_activation == "relu2",
        "granite4": cfg.granite is not None,
        "phi3_longrope": cfg.rope.rope_type == "longrope" and cfg.rotary_dim < cfg.head_dim,
    }[arch]


def test_gguf_file_loads_as_the_checkpoint(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny_qwen3_dir, tmp_path / "tiny-qwen3.gguf", "f32")
    cfg, permuted = config_from_gguf(GGUFFile(path))
    assert not permuted and cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm
    assert (cfg.head_dim, cfg.num_heads, cfg.hidden_size) == (32, 4, 64)
    model, _ = load_gguf_model(path, torch.device("cpu"), torch.float32)
    norm = model.layers[1].attention.k_norm
    assert norm is not None and not torch.all(norm.weight == 1)
    runner = ModelRunner(EngineConfig.from_options(str(path), tokenizer=str(tiny_qwen3_dir),
                                                   num_kv_blocks=64, dtype="float32"))
    ids = runner.tokenizer.encode(PROMPT)
    with torch.no_grad():
        want = hf_model(tiny_qwen3_dir)(torch.tensor([ids])).logits[0, -1]
    got = runner.execute([SeqChunk(ids, 0, list(range(8)), True)])[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_q8_0_gguf_runs_on_its_blocks_with_the_graph(tiny_qwen3_dir: Path,
                                                      tmp_path: Path) -> None:
    """`--quantization gguf` on a Qwen3 file: the linears stay Q8_0 blocks and decode
    steps take the GGUF graph, whose head norms agree with the torch model on the same
    blocks."""
    path = str(write_gguf(tiny_qwen3_dir, tmp_path / "tiny-qwen3-q8.gguf", "q8_0"))
    options = dict(tokenizer=str(tiny_qwen3_dir), num_kv_blocks=64, dtype="float32",
                   quantization="gguf")
    eager, graph = (ModelRunner(EngineConfig.from_options(path, enforce_eager=e, **options))
                    for e in (True, False))
    assert graph.decode_graph is not None and eager.decode_graph is None
    ids = eager.tokenizer.encode(PROMPT)
    want_tokens, want = decode_logits(eager, ids, 6)
    got_tokens, got = decode_logits(graph, ids, 6)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()  # int8 activations here
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def test_base_model_checkpoint_embeds_as_transformers(tiny_qwen3_dir: Path,
                                                      tmp_path: Path) -> None:
    """Qwen3-Embedding ships its base model (`Qwen3Model`'s tensor names, no LM head)
    under a config naming `Qwen3ForCausalLM`: it loads, and an embedding is the last
    token's final hidden state, normalized, as sentence-transformers computes it."""
    from transformers import AutoModel

    base = AutoModel.from_pretrained(str(tiny_qwen3_dir), dtype=torch.float32).eval()
    out = tmp_path / "qwen3-embedding"
    base.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_qwen3_dir / name).exists():
            (out / name).write_bytes((tiny_qwen3_dir / name).read_bytes())
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]  # as Qwen3-Embedding's config.json says
    config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config))
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert "embed_tokens.weight" in names and not any(n.startswith("model.") for n in names)

    llm = LLM(str(out), num_kv_blocks=64, dtype="float32")
    texts = ["rivers run to the sea", "What is the capital of France?"]
    got = [torch.tensor(o.outputs.embedding) for o in llm.embed(texts)]
    for text, vector in zip(texts, got, strict=True):
        ids = llm.engine.tokenizer.encode(text)
        with torch.no_grad():
            hidden = base(torch.tensor([ids])).last_hidden_state[0, -1]
        torch.testing.assert_close(vector, torch.nn.functional.normalize(hidden, dim=-1),
                                   atol=1e-5, rtol=1e-4)


def test_smollm3_nope_layers_from_either_config_field() -> None:
    from sluice.engine.models.loader import UnsupportedModelError, config_from_hf

    base = {"architectures": ["SmolLM3ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4}
    by_interval = config_from_hf({**base, "no_rope_layer_interval": 4})
    assert by_interval.no_rope_layers == (1, 1, 1, 0, 1, 1, 1, 0)
    assert [by_interval.uses_rope(i) for i in (2, 3)] == [True, False]
    listed = config_from_hf({**base, "no_rope_layers": [0, 1, 1, 1, 1, 1, 1, 1]})
    assert not listed.uses_rope(0) and listed.uses_rope(7)
    assert config_from_hf({**base, "architectures": ["LlamaForCausalLM"]}).no_rope_layers == ()
    with pytest.raises(UnsupportedModelError) as err:
        config_from_hf({**base, "no_rope_layers": [1, 0]})
    assert err.value.param == "model" and "2 entries for 8 layers" in str(err.value)


@pytest.mark.parametrize(("arch", "targets"), [
    ("granite", ("q_proj", "o_proj", "down_proj", "gate_proj")),
    ("gemma2", ("q_proj", "o_proj", "down_proj", "gate_proj")),
    ("glm", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")),
    ("phi3", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),  # Phi-3's fused modules
    ("helium", ("q_proj", "k_proj", "gate_proj", "up_proj")),
    ("arcee", ("q_proj", "k_proj", "up_proj", "down_proj"))])
def test_lora_adapter_on_folded_weights_equals_the_merged_model(
        request: pytest.FixtureRequest, tmp_path: Path, arch: str,
        targets: tuple[str, ...]) -> None:
    """Granite's multipliers are folded into q_proj, o_proj and down_proj, Gemma 2's score
    scale into q_proj, GLM's and Helium's Q and K rows reordered (RoPE over adjacent
    pairs), Arcee's MLP has up_proj alone, Phi-3's and GLM's checkpoints fuse qkv_proj
    and gate_up_proj (one A, B split by the parts' outputs): an adapter on those modules
    is scaled, reordered, split and placed the same way, so it gives what peft's merged
    model gives."""
    hf_dir: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    adapter_equals_merged_model(hf_dir, tmp_path, targets)


ADAPTER_PROMPTS = [[311, 4242, 977, 12345, 555, 18], [900, 901, 902]]
ADAPTER_PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)


def adapter_equals_merged_model(hf_dir: Path, tmp_path: Path, targets: tuple[str, ...]) -> LLM:
    """A peft adapter on `targets` gives peft's merged model's greedy tokens and logprobs
    (and not the base's); the LoRA engine it ran on."""
    adapter = make_adapter(hf_dir, tmp_path / "adapter", r=4, alpha=8, seed=3, targets=targets)
    merged = merge_adapter(hf_dir, adapter, tmp_path / "merged")
    options = dict(dtype="float32", num_kv_blocks=64, block_size=8)

    def run(llm: LLM, lora: LoRARequest | None = None) -> list[tuple[list[int], float]]:
        outs = llm.generate(ADAPTER_PROMPTS, ADAPTER_PARAMS,
                            lora_request=[lora] * len(ADAPTER_PROMPTS))
        return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob or 0.0) for o in outs]

    want = run(LLM(str(merged), **options))
    llm = LLM(str(hf_dir), enable_lora=True, max_lora_rank=8, **options)
    got, base = run(llm, LoRARequest("a", str(adapter))), run(llm)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, lp), (_, lp_want), (_, lp_base) in zip(got, want, base, strict=True):
        assert lp == pytest.approx(lp_want, abs=1e-3)
        assert abs(lp - lp_base) > 1e-2  # the adapter changes the model
    return llm


def one_module_adapter(out: Path, module: str, d_in: int, d_out: int) -> Path:
    """A PEFT adapter directory of rank 4 on one MLP `module` of layer 0, zeros."""
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": [module]}))
    prefix = f"base_model.model.model.layers.0.mlp.{module}"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(4, d_in),
               f"{prefix}.lora_B.weight": torch.zeros(d_out, 4)},
              str(out / "adapter_model.safetensors"))
    return out


MOE_BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def test_moe_configs_of_mixtral_and_qwen3_moe() -> None:
    from sluice.engine.models.llama import MoEConfig
    from sluice.engine.models.loader import config_from_hf
    from sluice.protocol.errors import InvalidRequestError

    qwen = {**MOE_BASE, "architectures": ["Qwen3MoeForCausalLM"]}
    # the hub's config.json: every second layer sparse, but layer 3 dense by name
    hub = config_from_hf({**qwen, "num_experts": 8, "decoder_sparse_step": 2,
                          "mlp_only_layers": [3], "norm_topk_prob": True})
    assert hub.qk_norm and hub.moe == MoEConfig(num_experts=8, top_k=2, intermediate_size=32,
                                                norm_topk_prob=True, dense_layers=(0, 2, 3, 4))
    assert [hub.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    # transformers 5 saves the count as num_local_experts; norm_topk_prob defaults off
    saved = config_from_hf({**qwen, "num_local_experts": 8})
    assert saved.moe is not None and saved.moe.num_experts == 8
    assert not saved.moe.norm_topk_prob and saved.moe.dense_layers == ()
    mixtral = config_from_hf({**MOE_BASE, "architectures": ["MixtralForCausalLM"],
                              "num_local_experts": 4})
    assert mixtral.moe is not None and not mixtral.qk_norm
    assert (mixtral.moe.num_experts, mixtral.moe.intermediate_size) == (4, 128)  # the MLP's
    assert mixtral.moe.norm_topk_prob and mixtral.moe.hf_parts == ("w1", "w3", "w2")
    # FLOPs count the router and the two experts a token runs, not all four
    attn = 64 * (64 + 2 * 32) + 64 * 64
    assert mixtral.num_parameters() == 6 * (attn + 64 * 4 + 3 * 2 * 64 * 128) + 100 * 64
    qwen2 = config_from_hf({**MOE_BASE, "architectures": ["Qwen2MoeForCausalLM"],
                            "num_experts": 4, "shared_expert_intermediate_size": 48})
    assert qwen2.qkv_bias and qwen2.moe is not None
    assert qwen2.moe.shared_intermediate_size == 48 and not qwen2.moe.norm_topk_prob
    assert qwen2.num_parameters() == 6 * (attn + 64 * 4 + 3 * 2 * 64 * 32 + 64 * (1 + 3 * 48)) \
        + 100 * 64  # the router, two experts, the shared one and its gate
    olmoe = config_from_hf({**MOE_BASE, "architectures": ["OlmoeForCausalLM"],
                            "num_experts": 4})
    assert olmoe.qk_norm_whole and not olmoe.qk_norm and olmoe.moe is not None
    assert (olmoe.moe.intermediate_size, olmoe.moe.norm_topk_prob) == (128, False)
    with pytest.raises(InvalidRequestError) as err:
        config_from_hf({**MOE_BASE, "architectures": ["OlmoeForCausalLM"], "num_experts": 4,
                        "clip_qkv": 8.0})
    assert err.value.param == "model" and "clip_qkv" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        config_from_hf({**qwen, "num_experts": 2, "num_experts_per_tok": 3})
    assert err.value.param == "model" and "num_experts_per_tok 3" in str(err.value)


@pytest.mark.parametrize("norm", [True, False])
def test_sparse_moe_equals_each_token_through_its_experts(norm: bool) -> None:
    """Grouping a step's tokens by expert gives what running each token through its own
    top-k experts gives (many tokens, some experts chosen by none)."""
    from sluice.engine.models.llama import LlamaConfig, MoEConfig, SparseMoE

    moe = MoEConfig(num_experts=6, top_k=2, intermediate_size=16, norm_topk_prob=norm)
    cfg = LlamaConfig(architecture="MixtralForCausalLM", vocab_size=10, hidden_size=24,
                      intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=12, rms_norm_eps=1e-5, max_position_embeddings=64, moe=moe)
    torch.manual_seed(0)
    layer = SparseMoE(cfg, moe).to_empty(device="cpu")
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    with torch.no_grad():
        layer.gate.weight[5] = -10.0  # expert 5's score is lowest for (nearly) every token
        x = torch.randn(41, 24)
        got = layer(x)
        want = torch.zeros_like(x)
        for t in range(x.shape[0]):
            probs = torch.softmax(x[t] @ layer.gate.weight.T, -1)
            top = probs.topk(2)
            weights = top.values / top.values.sum() if norm else top.values
            for w, e in zip(weights, top.indices.tolist(), strict=True):
                expert = layer.experts[e]
                gate, up = (x[t] @ expert.w13.weight.T).chunk(2)
                want[t] += w * (expert.w2.weight @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_model_takes_attention_adapters_and_runs_without_the_decode_graph(
        request: pytest.FixtureRequest, tmp_path: Path, arch: str) -> None:
    """A mixture of experts takes LoRA adapters on its attention (q/k/v/o: peft's merged
    model's outputs, Qwen3-MoE's dense layer too), and refuses one with an MLP tensor
    naming it (the experts take none); it decodes without the decode graph."""
    from sluice.protocol.errors import InvalidRequestError

    hf_dir: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    llm = adapter_equals_merged_model(hf_dir, tmp_path, ("q_proj", "k_proj", "v_proj", "o_proj"))
    cfg = llm.engine.runner.model_config
    mlp = one_module_adapter(tmp_path / "mlp", "down_proj", cfg.intermediate_size,
                             cfg.hidden_size)  # (a dense MLP's; peft's on experts name them)
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(ADAPTER_PROMPTS[:1], ADAPTER_PARAMS, lora_request=LoRARequest("mlp", str(mlp)))
    assert err.value.param == "lora_path" and "down_proj, not a LoRA target" in str(err.value)
    assert llm.engine.runner.decode_graph is None and llm.engine.runner.wide_graph is None


def test_moe_model_in_bfloat16_follows_float32(tiny_qwen3_moe_dir: Path) -> None:
    """bfloat16 weights (oneDNN's packed linears for every expert, where the CPU has
    them): the same greedy tokens for a few steps as float32, logits within bf16's
    rounding."""
    runners = [ModelRunner(EngineConfig.from_options(str(tiny_qwen3_moe_dir), num_kv_blocks=64,
                                                     block_size=4, dtype=d))
               for d in ("float32", "bfloat16")]
    ids = runners[0].tokenizer.encode(PROMPT)
    (want_tokens, want), (got_tokens, got) = (decode_logits(r, ids, 4) for r in runners)
    assert got_tokens[:2] == want_tokens[:2]
    assert float((got - want).norm() / want.norm()) < 0.05


@pytest.mark.parametrize("arch,linears", [("qwen3moe", "f32"), ("qwen3moe", "q8_0"),
                                          ("llama", "f32"), ("qwen2moe", "f32"),
                                          ("olmoe", "f32")])
def test_moe_gguf_file_loads_as_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               arch: str, linears: str) -> None:
    """llama.cpp's `qwen3moe` file, a `llama` file with experts (a Mixtral: Q/K rows
    permuted), a `qwen2moe` file (its shared expert, weights not renormalized) and an
    `olmoe` file (Q/K norms over all heads, weights not renormalized), from
    tiny checkpoints with every layer sparse (what llama.cpp computes): the same logits
    as transformers (Q8_0: within its rounding), and `--quantization gguf` keeps the
    experts dense."""
    from tiny_models import make_tiny_checkpoint

    monkeypatch.setenv("SLUICE_WEIGHTS_CACHE", str(tmp_path / "cache"))  # converted here
    hf_arch = {"qwen3moe": "qwen3_moe", "llama": "mixtral", "qwen2moe": "qwen2_moe",
               "olmoe": "olmoe"}[arch]
    options = {"norm_topk_prob": True, "mlp_only_layers": []} if arch == "qwen3moe" else {}
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", hf_arch, seed=4, **options)
    path = write_gguf(hf_dir, tmp_path / f"tiny-{arch}.gguf", linears, arch)
    cfg, permuted = config_from_gguf(GGUFFile(path))
    assert cfg.moe is not None and permuted == (arch == "llama")
    assert cfg.architecture == {"qwen3moe": "Qwen3MoeForCausalLM", "llama": "MixtralForCausalLM",
                                "qwen2moe": "Qwen2MoeForCausalLM",
                                "olmoe": "OlmoeForCausalLM"}[arch]
    assert cfg.moe.norm_topk_prob == (arch not in ("qwen2moe", "olmoe"))
    assert cfg.moe.dense_layers == () and cfg.qk_norm_whole == (arch == "olmoe")
    assert (cfg.moe.num_experts, cfg.moe.top_k) == ((8, 3) if arch == "qwen3moe" else (4, 2))
    assert cfg.moe.shared_intermediate_size == (48 if arch == "qwen2moe" else 0)
    runner = ModelRunner(EngineConfig.from_options(
        str(path), tokenizer=str(hf_dir), num_kv_blocks=64, dtype="float32",
        quantization="gguf" if linears == "q8_0" else "none"))
    ids = runner.tokenizer.encode(PROMPT)
    with torch.no_grad():
        want = hf_model(hf_dir)(torch.tensor([ids])).logits[0, -1]
    got = runner.execute([SeqChunk(ids, 0, list(range(8)), True)])[0]
    if linears == "f32":
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:
        assert runner.gguf_blocks and not any("experts" in n for n in runner.gguf_blocks)
        assert float((got - want).norm() / want.norm()) < 0.05  # Q8_0 rounding: 2% here


def test_phi3_fused_weights_split(tiny_phi3_dir: Path) -> None:
    """Phi-3's checkpoint fuses Q|K|V and gate|up: split into the separate projections,
    whose concatenation is the checkpoint's tensor again (its longrope and Phi-4-mini's
    partial rotation: test_rope_scaling.py)."""
    from safetensors.torch import load_file

    from sluice.engine.models.loader import config_from_hf, read_config, split_fused_weights

    cfg = config_from_hf(read_config(tiny_phi3_dir))
    fused = load_file(str(tiny_phi3_dir / "model.safetensors"))
    split = split_fused_weights(cfg, fused)
    attn, mlp = "model.layers.1.self_attn.", "model.layers.1.mlp."
    assert attn + "qkv_proj.weight" not in split and mlp + "gate_up_proj.weight" not in split
    assert split[attn + "k_proj.weight"].shape == (cfg.kv_size, cfg.hidden_size)
    assert torch.equal(torch.cat([split[attn + f"{n}_proj.weight"] for n in "qkv"]),
                       fused[attn + "qkv_proj.weight"])
    assert torch.equal(torch.cat([split[mlp + "gate_proj.weight"], split[mlp + "up_proj.weight"]]),
                       fused[mlp + "gate_up_proj.weight"])


def test_moe_verify_steps_keep_plain_decodings_tokens(tiny_mixtral_dir: Path) -> None:
    """A predicted output's drafts are verified several rows a forward, each row routed
    to its own experts: the answer is plain decoding's, token for token, for the exact
    prediction and an edited one."""
    llm = LLM(str(tiny_mixtral_dir), dtype="float32", num_kv_blocks=64, block_size=8)
    llm.engine.core.spec.planner.adaptive = False  # every draft verified: no timing
    prompts = [[311, 4242, 977, 12345, 555, 18], [900, 901, 902]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    edited = plain[0][:10] + [7, 8, 9] + plain[0][13:]
    for prediction in (plain[0], edited):
        outs = llm.generate(prompts, [dataclasses.replace(params, prediction=prediction),
                                      params])
        assert [o.outputs[0].token_ids for o in outs] == plain
        assert outs[0].outputs[0].accepted_prediction_tokens >= 15


# google/gemma-3-1b-it's config.json as the hub serves it (transformers 4.50's fields)
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
    "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26,
    "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "vocab_size": 262144}


def test_gemma3_config_from_the_hub_and_from_transformers_5(tiny_gemma3_dir: Path) -> None:
    """Gemma 3-1B's config: every sixth layer global, the others a 512-token window with
    RoPE base 10,000 (the global ones 1,000,000), the context not capped at the window,
    the head tied though the file does not say; transformers 5's `layer_types` and
    per-kind `rope_parameters` read the same way. Another MLP activation, bidirectional
    attention and a soft cap outside Gemma are refused by name."""
    from sluice.engine.models.loader import UnsupportedModelError, config_from_hf, read_config

    cfg = config_from_hf(GEMMA3_1B)
    assert cfg.gemma is not None and cfg.tie_word_embeddings and cfg.qk_norm
    assert [i for i in range(26) if cfg.window(i) is None] == [5, 11, 17, 23]
    assert cfg.window(0) == 512 and cfg.max_position_embeddings == 32768
    assert (cfg.rope.theta, cfg.local_rope.theta) == (1e6, 1e4)
    assert cfg.gemma.query_pre_attn_scalar == 256 and cfg.head_dim == 256
    tiny = config_from_hf(read_config(tiny_gemma3_dir))
    assert tiny.gemma is not None and [tiny.window(i) for i in (0, 1)] == [8, None]
    assert (tiny.rope.theta, tiny.local_rope.theta) == (1e6, 1e4)
    for bad, named in (({"architectures": ["LlamaForCausalLM"], "hidden_activation": None,
                        "final_logit_softcapping": 30.0}, "final_logit_softcapping"),
                       ({"hidden_activation": "gelu"}, "'gelu'"),
                       ({"architectures": ["LlamaForCausalLM"], "hidden_activation": None,
                         "use_bidirectional_attention": True}, "Gemma 3 (EmbeddingGemma) only"),
                       ({"layer_types": ["sliding_attention"] * 3}, "layer_types")):
        with pytest.raises(UnsupportedModelError) as err:
            config_from_hf({**GEMMA3_1B, **bad})
        assert err.value.param == "model" and named in str(err.value)
    # EmbeddingGemma's: transformers' window |q - k| < sliding_window // 2 + 1
    bidirectional = config_from_hf({**GEMMA3_1B, "use_bidirectional_attention": True})
    assert bidirectional.bidirectional
    assert bidirectional.sliding_window == GEMMA3_1B["sliding_window"] // 2 + 1


def test_gemma3_in_bfloat16_follows_float32(tiny_gemma3_dir: Path) -> None:
    """Gemma 3's decodes take the decode graph (its blocks against the torch model's:
    test_decode_graph_runs_the_architecture); bfloat16 follows float32 past the sliding
    window."""
    runners = [ModelRunner(EngineConfig.from_options(str(tiny_gemma3_dir), num_kv_blocks=64,
                                                     block_size=4, dtype=d))
               for d in ("float32", "bfloat16")]
    assert runners[0].decode_graph is not None
    ids = runners[0].tokenizer.encode(PROMPT)
    assert len(ids) > 8  # past the tiny model's window
    (want_tokens, want), (got_tokens, got) = (decode_logits(r, ids, 4) for r in runners)
    assert got_tokens[:2] == want_tokens[:2]
    assert float((got - want).norm() / want.norm()) < 0.05


@pytest.mark.parametrize("arch,linears", [("gemma3", "f32"), ("gemma3", "q8_0"),
                                          ("gemma2", "f32")])
def test_gemma_gguf_file_loads_as_the_checkpoint(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 arch: str, linears: str) -> None:
    """A `gemma3` / `gemma2` file as llama.cpp's converter writes one (norms with 1
    added, its own names for the branch norms, the window and which layers slide,
    Gemma 2's soft caps): the same config as the checkpoint's, and prefill and decode
    logits equal transformers' on the checkpoint (float32 linears) or close to them
    (Q8_0 blocks dequantized). The file has no score scale: llama.cpp's is
    1/sqrt(head_dim), as every Gemma but the 27B models has it, so the checkpoint here
    has that too (the fixtures' 24 is not head_dim)."""
    from sluice.engine.models.loader import config_from_hf, read_config
    from tiny_models import make_tiny_checkpoint

    monkeypatch.setenv("SLUICE_WEIGHTS_CACHE", "off")
    hf_dir = make_tiny_checkpoint(tmp_path / f"tiny-{arch}", arch, query_pre_attn_scalar=32)
    path = write_gguf(hf_dir, tmp_path / f"tiny-{arch}-{linears}.gguf", linears, arch=arch)
    cfg, permuted = config_from_gguf(GGUFFile(path))
    want_cfg = config_from_hf(read_config(hf_dir))
    assert not permuted and cfg.gemma == want_cfg.gemma and cfg.tie_word_embeddings
    got, want = gguf_and_checkpoint_logits(path, hf_dir)
    if linears == "f32":
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:
        assert float((got - want).norm() / want.norm()) < 0.05  # Q8_0 rounding: 2% here


def test_phi3_gguf_file_loads_as_the_checkpoint(tiny_phi3_dir: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A `phi3` file (Q|K|V in `attn_qkv`, gate|up in `ffn_up`, as llama.cpp's converter
    keeps them fused): split at load, its logits equal transformers' on the checkpoint,
    and a sliding window caps the context as the checkpoint's does (longrope's factor
    tensors and Phi-4-mini's partial rotation: test_rope_scaling.py)."""
    monkeypatch.setenv("SLUICE_WEIGHTS_CACHE", "off")
    path = write_gguf(tiny_phi3_dir, tmp_path / "tiny-phi3.gguf", "f32", arch="phi3")
    assert config_from_gguf(GGUFFile(path))[0].architecture == "Phi3ForCausalLM"
    got, want = gguf_and_checkpoint_logits(path, tiny_phi3_dir)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    windowed = write_gguf(tiny_phi3_dir, tmp_path / "window.gguf", "f32", arch="phi3",
                          metadata=lambda w: w.add_sliding_window(64))
    assert config_from_gguf(GGUFFile(windowed))[0].max_position_embeddings == 64


@pytest.mark.parametrize("arch", ["granite", "granitemoe"])
def test_granite_gguf_file_loads_as_the_checkpoint(request: pytest.FixtureRequest,
                                                   tmp_path: Path, arch: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`granite` and `granitemoe` files as llama.cpp's converter writes them (the
    multipliers as `attention.scale`, `embedding_scale`, `residual_scale`, `logit_scale`;
    Q/K rows permuted; Granite MoE's stacked experts split per projection): the same
    multipliers as the checkpoint's config, and logits equal transformers' on it."""
    from sluice.engine.models.loader import config_from_hf, read_config

    monkeypatch.setenv("SLUICE_WEIGHTS_CACHE", "off")
    hf_dir: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    path = write_gguf(hf_dir, tmp_path / f"tiny-{arch}.gguf", "f32", arch=arch)
    cfg, permuted = config_from_gguf(GGUFFile(path))
    want_scales = config_from_hf(read_config(hf_dir)).granite
    assert permuted and cfg.granite is not None and want_scales is not None
    assert dataclasses.astuple(cfg.granite) == pytest.approx(dataclasses.astuple(want_scales))
    assert (cfg.moe is not None) == (arch == "granitemoe")
    got, want = gguf_and_checkpoint_logits(path, hf_dir)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_smollm3_gguf_file_loads_as_the_checkpoint(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A `smollm3` file (Q/K rows permuted, as its converter is Llama's): every fourth
    layer without RoPE, as llama.cpp fixes it for SmolLM3 (SmolLM3-3B's
    `no_rope_layer_interval`); logits equal transformers' on a 4-layer checkpoint so set."""
    from tiny_models import make_tiny_checkpoint

    monkeypatch.setenv("SLUICE_WEIGHTS_CACHE", "off")
    hf_dir = make_tiny_checkpoint(tmp_path / "tiny-smollm3", "smollm3", num_hidden_layers=4,
                                  no_rope_layers=[1, 1, 1, 0])
    path = write_gguf(hf_dir, tmp_path / "tiny-smollm3.gguf", "f32", arch="smollm3")
    cfg, permuted = config_from_gguf(GGUFFile(path))
    assert permuted and cfg.no_rope_layers == (1, 1, 1, 0)
    got, want = gguf_and_checkpoint_logits(path, hf_dir)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# google/gemma-2-2b-it's config.json as the hub serves it (transformers 4.42's fields)
GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
    "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304, "intermediate_size": 9216, "max_position_embeddings": 8192,
    "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26,
    "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
    "vocab_size": 256000}


def test_gemma2_config_from_the_hub(tiny_gemma2_dir: Path) -> None:
    """Gemma 2-2B: every other layer local (the even ones) with a 4,096-token window and
    the global RoPE, scores capped at 50 and logits at 30, no head norms, the context not
    capped at the window, the head tied; the tiny checkpoint's transformers-5 config the
    same way. Its decodes take the decode graph; its head caps the logits."""
    from sluice.engine.models.llama import SoftcappedHead
    from sluice.engine.models.loader import config_from_hf, read_config

    cfg = config_from_hf(GEMMA2_2B)
    assert cfg.gemma is not None and cfg.tie_word_embeddings and not cfg.qk_norm
    assert [cfg.window(i) for i in range(4)] == [4096, None, 4096, None]
    assert cfg.local_rope == cfg.rope and cfg.max_position_embeddings == 8192
    assert (cfg.gemma.attn_softcap, cfg.gemma.final_softcap) == (50.0, 30.0)
    tiny = config_from_hf(read_config(tiny_gemma2_dir))
    assert tiny.gemma is not None and (tiny.gemma.attn_softcap, tiny.gemma.final_softcap) == (5, 3)
    runner = ModelRunner(EngineConfig.from_options(str(tiny_gemma2_dir), num_kv_blocks=64,
                                                   block_size=4, dtype="float32"))
    assert runner.decode_graph is not None and isinstance(runner.model.output, SoftcappedHead)
    logits = runner.execute([SeqChunk(runner.tokenizer.encode(PROMPT), 0, list(range(16)),
                                      True)])
    assert float(logits.abs().max()) < 3.0


def test_olmo2_block_and_gguf_file(tiny_olmo2_dir: Path, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """OLMo 2: one norm over all of Q's heads and one over K's, and each branch's output
    normalized before its residual add with no norm of its input (greedy tokens against
    transformers: test_hf_equivalence.py). Its checkpoint names no input norm; an `olmo2`
    file (the branch norms named as Gemma's, `post_attention_norm` and `post_ffw_norm`)
    loads as the checkpoint; decodes take the decode graph
    (test_decode_graph_runs_the_architecture)."""
    from sluice.engine.models.llama import ResidualAdd
    from sluice.engine.models.loader import config_from_hf, read_config

    monkeypatch.setenv("SLUICE_WEIGHTS_CACHE", "off")
    cfg = config_from_hf(read_config(tiny_olmo2_dir))
    assert cfg.qk_norm_whole and cfg.block_norms == BLOCK_NORMS["olmo2"] and not cfg.qk_norm
    path = write_gguf(tiny_olmo2_dir, tmp_path / "tiny-olmo2.gguf", "f32", arch="olmo2")
    gguf_cfg = config_from_gguf(GGUFFile(path))[0]
    assert (gguf_cfg.architecture, gguf_cfg.qk_norm_whole, gguf_cfg.block_norms) == (
        "Olmo2ForCausalLM", True, BLOCK_NORMS["olmo2"])
    got, want = gguf_and_checkpoint_logits(path, tiny_olmo2_dir)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    runner = ModelRunner(EngineConfig.from_options(str(tiny_olmo2_dir), num_kv_blocks=64,
                                                   block_size=4, dtype="float32"))
    assert runner.decode_graph is not None
    block = runner.model.layers[0]
    assert isinstance(block.attention_norm, ResidualAdd)
    assert isinstance(block.ffn_norm, ResidualAdd)
    assert block.post_attention_norm is not None and block.post_ffn_norm is not None


def test_olmo3_config_windows_and_ropes(tiny_olmo3_dir: Path) -> None:
    """OLMo 3: OLMo 2's block, every fourth layer global and the others through
    `sliding_window`, the global layers' YaRN and the sliding layers' plain RoPE of the
    same base, from a config.json in transformers 4's style (`rope_scaling` the global
    layers', shaped like Olmo-3-7B's) and transformers 5's (per-kind `rope_parameters`, the
    tiny checkpoint); the context is YaRN's, not capped at the window; the decode graph
    takes its decodes, both tables (greedy tokens against transformers:
    test_hf_equivalence.py)."""
    from sluice.engine.models.llama import RopeConfig
    from sluice.engine.models.loader import config_from_hf, read_config

    cfg = config_from_hf({
        "architectures": ["Olmo3ForCausalLM"], "vocab_size": 100278, "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 8, "num_attention_heads": 32,
        "num_key_value_heads": 32, "max_position_embeddings": 65536, "rms_norm_eps": 1e-6,
        "rope_theta": 500000, "sliding_window": 4096, "rope_scaling": {
            "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
            "attention_factor": 1.2079, "beta_fast": 32, "beta_slow": 1}})
    assert cfg.block_norms == BLOCK_NORMS["olmo2"] and cfg.qk_norm_whole and cfg.gemma is None
    assert [cfg.window(i) for i in range(8)] == [4096, 4096, 4096, None] * 2
    assert cfg.rope.rope_type == "yarn" and cfg.local_rope == RopeConfig(theta=500000.0)
    assert cfg.max_position_embeddings == 65536
    tiny = config_from_hf(read_config(tiny_olmo3_dir))
    assert [tiny.window(i) for i in (0, 1)] == [8, None] and tiny.max_position_embeddings == 128
    assert (tiny.rope.rope_type, tiny.local_rope) == ("yarn", RopeConfig(theta=10000.0))
    runner = ModelRunner(EngineConfig.from_options(str(tiny_olmo3_dir), num_kv_blocks=64,
                                                   block_size=4, dtype="float32"))
    assert runner.decode_graph is not None and runner.model.local_rope is not None
    assert runner.decode_graph.local is not None


def test_exaone4_configs_with_and_without_windows(tiny_exaone4_dir: Path) -> None:
    """EXAONE 4: OLMo 2's block with per-head Q/K norms. Without a window (the 1.2B
    model's `sliding_window` null) every layer is global and rotates; with one (the 32B
    model's, its pattern spelled "LLLG") three layers in four slide with RoPE and the
    fourth is global without it, as transformers' attention skips RoPE there (greedy
    tokens against transformers on the tiny checkpoint: test_hf_equivalence.py)."""
    from sluice.engine.models.loader import config_from_hf, read_config

    base = {"architectures": ["Exaone4ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
            "intermediate_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 32,
            "num_key_value_heads": 8, "max_position_embeddings": 65536, "rope_theta": 1e6}
    small = config_from_hf({**base, "sliding_window": None,
                            "layer_types": ["full_attention"] * 8})
    assert small.block_norms == BLOCK_NORMS["olmo2"] and small.qk_norm and not small.qk_norm_whole
    assert small.sliding_window is None and all(small.uses_rope(i) for i in range(8))
    large = config_from_hf({**base, "sliding_window": 4096, "sliding_window_pattern": "LLLG"})
    assert [large.window(i) for i in range(8)] == [4096, 4096, 4096, None] * 2
    assert [large.uses_rope(i) for i in range(4)] == [True, True, True, False]
    assert large.max_position_embeddings == 65536  # the window runs: not a cap
    tiny = config_from_hf(read_config(tiny_exaone4_dir))
    assert [tiny.window(i) for i in (0, 1)] == [8, None] and tiny.no_rope_layers == (1, 0)


def test_granite4_transformer_models_and_what_is_refused(tmp_path: Path) -> None:
    """Granite 4.0's transformer models (`GraniteMoeHybridForCausalLM` with every layer
    attention): Granite's multipliers, the MLP under `shared_mlp`; with
    `position_embedding_type` None no layer rotates, and the logits still equal
    transformers'. The Mamba hybrids (a "mamba" layer) and experts are refused by name.
    (Greedy tokens with RoPE on every engine option: test_hf_equivalence.py.)"""
    from sluice.engine.models.loader import UnsupportedModelError, config_from_hf, read_config
    from tiny_models import make_tiny_checkpoint

    nope = make_tiny_checkpoint(tmp_path / "nope", "granitemoehybrid",
                                position_embedding_type=None)
    cfg = config_from_hf(read_config(nope))
    assert cfg.granite is not None and cfg.intermediate_size == 128
    assert cfg.no_rope_layers == (0, 0)
    runner = ModelRunner(EngineConfig.from_options(str(nope), num_kv_blocks=64, block_size=4,
                                                   dtype="float32"))
    ids = runner.tokenizer.encode(PROMPT)
    tokens, got = decode_logits(runner, ids, 3)
    with torch.no_grad():
        want = hf_model(nope)(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    hub = {**read_config(nope), "layer_types": None}
    for bad, named in (({"layers_block_type": ["mamba", "attention"]}, "Mamba"),
                       ({"num_local_experts": 4}, "num_local_experts")):
        with pytest.raises(UnsupportedModelError) as err:
            config_from_hf({**hub, **bad})
        assert err.value.param == "model" and named in str(err.value)


def test_glm_configs_graph_and_lora_refused(tiny_glm_dir: Path, tiny_glm4_dir: Path) -> None:
    """GLM-4: `attention_bias` puts a bias on Q/K/V and not on o_proj, RoPE turns adjacent
    pairs of half of each head (reordered into halves at load); GLM-4-0414 normalizes each
    branch's input and output. The decode graph runs GLM-4's layers (greedy tokens against
    transformers, through the graph and eager: test_hf_equivalence.py); a LoRA adapter's
    Q/K rows are reordered alike (test_lora_adapter_on_folded_weights_equals_the_merged_model)."""
    from sluice.engine.models.loader import config_from_hf, read_config

    glm, glm4 = (config_from_hf(read_config(d)) for d in (tiny_glm_dir, tiny_glm4_dir))
    for cfg in (glm, glm4):
        assert cfg.rope_interleaved and cfg.rotary_dim == 8 and cfg.qkv_bias and not cfg.o_bias
    assert glm.block_norms == BLOCK_NORMS["llama"] and glm4.block_norms == BLOCK_NORMS["glm4"]
    runner = ModelRunner(EngineConfig.from_options(str(tiny_glm_dir), num_kv_blocks=64,
                                                   block_size=4, dtype="float32"))
    assert runner.decode_graph is not None


@pytest.mark.parametrize("arch", ["olmo3", "exaone4", "glm4"])
def test_windowed_and_glm4_gguf_files_load_as_the_checkpoint(
        request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        arch: str) -> None:
    """GGUF files as llama.cpp's converter writes them: OLMo 3's an `olmo2` file with
    `attention.sliding_window`, a flag a layer, and the global layers' YaRN (the sliding
    ones rotating plainly); EXAONE 4's `exaone4` with its window (its global layers
    without RoPE); GLM-4-0414's `glm4`, its Q/K rows as the checkpoint's (llama.cpp turns
    adjacent pairs), gate|up fused in `ffn_up`, its four block norms, Q/K/V bias, and the
    rotated width `rope.dimension_count`. Logits equal transformers' on the checkpoint."""

    monkeypatch.setenv("SLUICE_WEIGHTS_CACHE", "off")
    directory: Path = request.getfixturevalue(f"tiny_{arch}_dir")

    def exaone4(w: Any) -> None:
        w.add_sliding_window(8)
        w.add_sliding_window_pattern([True, False])

    def olmo3(w: Any) -> None:
        exaone4(w)
        add_yarn(w)

    extra = {"olmo3": olmo3, "exaone4": exaone4,
             "glm4": lambda w: w.add_rope_dimension_count(8)}[arch]
    path = write_gguf(directory, tmp_path / f"{arch}.gguf", "f32",
                      arch="olmo2" if arch == "olmo3" else arch, metadata=extra)
    cfg = config_from_gguf(GGUFFile(path))[0]
    if arch != "glm4":
        assert [cfg.window(i) for i in (0, 1)] == [8, None]
    got, want = gguf_and_checkpoint_logits(path, directory)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_arcee_mlp_without_a_gate(tiny_arcee_dir: Path, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Arcee's AFM: an MLP of relu(up)² with no gate (no gate tensor read, half the gate|up
    width), run by the decode graph too; a LoRA adapter on up_proj is its w13's, one on a
    gate_proj is refused naming it; its
    `arcee` GGUF file (Q/K rows permuted as Llama's, `ffn_up` and `ffn_down` alone, YaRN)
    runs as the checkpoint (greedy tokens against transformers on every engine option:
    test_hf_equivalence.py)."""

    from sluice.engine.models.loader import config_from_hf, read_config
    from sluice.protocol.errors import InvalidRequestError

    monkeypatch.setenv("SLUICE_WEIGHTS_CACHE", "off")
    cfg = config_from_hf(read_config(tiny_arcee_dir))
    assert cfg.mlp_activation == "relu2" and cfg.rope.rope_type == "yarn"
    runner = ModelRunner(EngineConfig.from_options(str(tiny_arcee_dir), num_kv_blocks=64,
                                                   block_size=4, dtype="float32"))
    assert runner.decode_graph is not None
    assert runner.model.layers[0].feed_forward.w13.weight.shape == (cfg.intermediate_size,
                                                                     cfg.hidden_size)
    lora = ModelRunner(EngineConfig.from_options(str(tiny_arcee_dir), num_kv_blocks=64,
                                                 enable_lora=True))
    # an adapter of a Llama of the same shapes, with a gate
    gated = one_module_adapter(tmp_path / "gated", "gate_proj", cfg.hidden_size,
                               cfg.intermediate_size)
    with pytest.raises(InvalidRequestError) as err:
        lora.load_lora(str(gated), 8)
    assert err.value.param == "lora_path" and "gate_proj, not a LoRA target" in str(err.value)

    path = write_gguf(tiny_arcee_dir, tmp_path / "arcee.gguf", "f32", arch="arcee",
                      metadata=add_yarn)
    got, want = gguf_and_checkpoint_logits(path, tiny_arcee_dir)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
