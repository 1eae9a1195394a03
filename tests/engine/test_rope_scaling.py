"""RoPE scalings beyond Llama 3's and a rotation over part of each head: YaRN (Qwen2.5 and
Qwen3 past their 32K, gpt-oss, Ministral), Phi-3/3.5/4-mini's longrope, and Phi-4-mini's
`partial_rotary_factor`. The frequencies and cos/sin factors against transformers' own
functions over many settings; whole tiny models against transformers' logits, through
the torch path and the native decode graph, from a checkpoint and from a GGUF file as
llama.cpp's converter writes one; the context each gives; what is refused."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tests.engine.test_architectures import PROMPT, decode_logits, hf_model

from sluice.engine.config import EngineConfig
from sluice.engine.model_runner import ModelRunner
from sluice.engine.models.gguf_file import GGUFFile
from sluice.engine.models.gguf_loader import config_from_gguf
from sluice.engine.models.llama import inv_frequencies
from sluice.engine.models.loader import config_from_hf, read_config
from sluice.protocol.errors import InvalidRequestError
from tiny_models import add_yarn, write_gguf

LONG_PROMPT = PROMPT * 3  # 45 tokens: past the tiny models' original context of 32

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "head_dim": 16, "rope_theta": 10000.0}


def hf_frequencies(config: dict[str, Any], seq_len: int) -> tuple[torch.Tensor, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    kind = hf.rope_parameters["rope_type"]
    inv, scale = ROPE_INIT_FUNCTIONS[kind](hf, "cpu", seq_len=seq_len)
    return inv, float(scale)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.3, 1.7, 2.5], "long_factor": [1.0, 4.0, 11.0, 29.0],
            "partial_rotary_factor": 0.5}


@pytest.mark.parametrize(("top", "rope", "context"), [
    ({"max_position_embeddings": 128}, YARN, 128),
    ({"max_position_embeddings": 128},
     {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False}, 128),
    ({"max_position_embeddings": 512}, {**YARN, "factor": 8.0, "mscale": 1.0,
                                        "original_max_position_embeddings": 64,
                                        "mscale_all_dim": 0.5}, 512),
    ({"max_position_embeddings": 128}, {**YARN, "attention_factor": 0.9}, 128),
    # Phi-3's top-level original context wins over the scaling's own
    ({"max_position_embeddings": 256, "original_max_position_embeddings": 64}, YARN, 256),
    ({"max_position_embeddings": 128}, LONGROPE, 32),  # within the original: short factors
    ({"max_position_embeddings": 128}, LONGROPE, 128),  # past it: the long ones
    ({"max_position_embeddings": 128}, {**LONGROPE, "attention_factor": 1.25}, 33),
    ({"max_position_embeddings": 32}, LONGROPE, 32),  # no extension: cos and sin unscaled
    # dynamic NTK: the base raised for the context served past the original, not within
    ({"max_position_embeddings": 32}, {"rope_type": "dynamic", "factor": 4.0}, 128),
    ({"max_position_embeddings": 32}, {"rope_type": "dynamic", "factor": 4.0}, 77),
    ({"max_position_embeddings": 32}, {"rope_type": "dynamic", "factor": 2.0,
                                       "partial_rotary_factor": 0.5}, 64),
    ({"max_position_embeddings": 32}, {"rope_type": "dynamic", "factor": 4.0}, 32),
])
def test_frequencies_and_factor_match_transformers(top: dict[str, int], rope: dict[str, Any],
                                                   context: int) -> None:
    """sluice's frequencies and cos/sin factor for a context equal transformers' for a
    sequence of that length, read from the same config.json (what the loader fills in:
    the original context, a missing factor)."""
    raw = {**BASE, **top, "rope_parameters": dict(rope)}
    cfg = config_from_hf(raw)
    got, scale = inv_frequencies(cfg.rope, cfg.rotary_dim, context)
    want, want_scale = hf_frequencies(raw, context)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale, rel=1e-6)
    if rope["rope_type"] == "longrope":
        assert cfg.rotary_dim == 8 and len(got) == 4


def test_contexts_and_refusals() -> None:
    """YaRN and dynamic NTK serve the original context times the factor (vLLM's rule; a
    config of 32,768 positions with Qwen's factor 4 serves 131,072), longrope the config's
    context; Phi-3's
    early "su" is longrope; a scaling's missing parameter and a rotation of an odd part
    of the head are refused by name."""
    yarn = config_from_hf({**BASE, "max_position_embeddings": 32768, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}})
    assert yarn.rope.rope_type == "yarn" and yarn.max_position_embeddings == 131072
    assert "type" not in yarn.rope.params and "rope_type" not in yarn.rope.params
    su = config_from_hf({**BASE, "max_position_embeddings": 131072,  # Phi-3-mini-128k's
                         "original_max_position_embeddings": 4096, "rope_scaling": {
                             "type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}})
    assert su.rope.rope_type == "longrope" and su.max_position_embeddings == 131072
    assert su.rope.params["factor"] == 32.0 and su.rotary_dim == 16
    dynamic = config_from_hf({**BASE, "max_position_embeddings": 4096,
                              "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    assert dynamic.rope.rope_type == "dynamic" and dynamic.max_position_embeddings == 8192
    no_long = {k: v for k, v in LONGROPE.items() if k != "long_factor"}
    with pytest.raises(InvalidRequestError) as err:
        config_from_hf({**BASE, "rope_parameters": no_long})
    assert err.value.param == "model" and "long_factor" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        config_from_hf({**BASE, "partial_rotary_factor": 0.1})  # 1 of 16
    assert err.value.param == "model" and "partial_rotary_factor" in str(err.value)


def runner(directory: Path, **options: Any) -> ModelRunner:
    return ModelRunner(EngineConfig.from_options(str(directory), num_kv_blocks=64, block_size=4,
                                                 dtype="float32", **options))


def max_error(r: ModelRunner, hf_dir: Path, prompt: str) -> tuple[float, float]:
    """The largest difference of r's logits (the prompt and 3 greedy steps) from
    transformers' on the checkpoint, and the largest logit."""
    ids = r.tokenizer.encode(prompt)
    tokens, got = decode_logits(r, ids, 3)
    with torch.no_grad():
        want = hf_model(hf_dir)(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:]
    return float((got - want).abs().max()), float(want.abs().max())


@pytest.mark.parametrize("eager", [True, False])
def test_longrope_over_part_of_each_head_matches_transformers(
        tiny_phi3_longrope_dir: Path, eager: bool) -> None:
    """A Phi-3 checkpoint with longrope over half of each head (Phi-4-mini's shape): served
    within the original context, its logits are transformers' (the short factors); served
    with the longer context, a prompt past the original length gets transformers' logits
    too (the long factors, which transformers picks for such a sequence), and a short
    prompt rotates with the long factors as well (one choice per served context, so it
    differs from transformers' short-factor logits). Eager, and through the native decode
    graph."""
    short = runner(tiny_phi3_longrope_dir, max_model_len=32, enforce_eager=eager)
    assert (short.decode_graph is None) == eager
    error, top = max_error(short, tiny_phi3_longrope_dir, PROMPT)
    assert error <= 1e-4 * top
    long = runner(tiny_phi3_longrope_dir, enforce_eager=eager)
    assert long.max_model_len == 128
    error, top = max_error(long, tiny_phi3_longrope_dir, LONG_PROMPT)
    assert error <= 1e-4 * top
    error, top = max_error(long, tiny_phi3_longrope_dir, PROMPT)
    assert error > 0.05 * top


@pytest.mark.parametrize("eager", [True, False])
def test_yarn_matches_transformers_past_the_original_context(tiny_qwen2_yarn_dir: Path,
                                                             eager: bool) -> None:
    """A Qwen2 checkpoint with YaRN (factor 4 over 32 positions) serves 128 positions, and a
    45-token prompt's logits are transformers' (eager and through the decode graph)."""
    r = runner(tiny_qwen2_yarn_dir, enforce_eager=eager)
    assert r.max_model_len == 128 and (r.decode_graph is None) == eager
    error, top = max_error(r, tiny_qwen2_yarn_dir, LONG_PROMPT)
    assert error <= 1e-4 * top


def test_phi3_longrope_gguf_file_matches_the_checkpoint(
        tiny_phi3_longrope_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `phi3` file as llama.cpp's converter writes Phi-3.5 / Phi-4-mini (the rotated width
    `rope.dimension_count`, the original context, both factor lists as tensors, cos and
    sin's factor `rope.scaling.attn_factor`) runs as the checkpoint, within the original
    context and past it."""
    monkeypatch.setenv("SLUICE_WEIGHTS_CACHE", "off")
    config = read_config(tiny_phi3_longrope_dir)
    rope = config["rope_parameters"]
    factor = config["max_position_embeddings"] / rope["original_max_position_embeddings"]

    def longrope(w: Any) -> None:
        w.add_rope_dimension_count(8)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(factor) / math.log(32)))
        for name in ("long", "short"):
            w.add_tensor(f"rope_factors_{name}.weight",
                         np.array(rope[f"{name}_factor"], dtype=np.float32))

    path = write_gguf(tiny_phi3_longrope_dir, tmp_path / "phi.gguf", "f32", arch="phi3",
                      metadata=longrope)
    cfg = config_from_gguf(GGUFFile(path))[0]
    assert cfg.rope.rope_type == "longrope" and cfg.rotary_dim == 8
    for options, prompt in (({"max_model_len": 32}, PROMPT), ({}, LONG_PROMPT)):
        r = runner(path, tokenizer=str(tiny_phi3_longrope_dir), **options)
        error, top = max_error(r, tiny_phi3_longrope_dir, prompt)
        assert error <= 1e-4 * top


def test_yarn_gguf_file_matches_the_checkpoint(tiny_qwen2_yarn_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A `qwen2` file with YaRN metadata (`rope.scaling.type`, its factor and original
    context) runs as the checkpoint and serves the same scaled context; DeepSeek's
    `yarn_log_multiplier` is refused by name."""
    monkeypatch.setenv("SLUICE_WEIGHTS_CACHE", "off")

    path = write_gguf(tiny_qwen2_yarn_dir, tmp_path / "yarn.gguf", "f32", arch="qwen2",
                      metadata=add_yarn)
    r = runner(path, tokenizer=str(tiny_qwen2_yarn_dir))
    assert r.max_model_len == 128
    error, top = max_error(r, tiny_qwen2_yarn_dir, LONG_PROMPT)
    assert error <= 1e-4 * top

    def deepseek(w: Any) -> None:
        add_yarn(w)
        w.add_rope_scaling_yarn_log_mul(0.1)

    bad = write_gguf(tiny_qwen2_yarn_dir, tmp_path / "bad.gguf", "f32", arch="qwen2",
                     metadata=deepseek)
    with pytest.raises(InvalidRequestError) as err:
        config_from_gguf(GGUFFile(bad))
    assert err.value.param == "model" and "yarn_log_multiplier" in str(err.value)


def test_longrope_factor_choice_is_part_of_the_kv_identity(tiny_phi3_longrope_dir: Path) -> None:
    """Two workers of one longrope model serving different contexts rotate their keys with
    different factors: the choice is in their KV blocks' identity, so a P/D hand-off
    between them is refused as a mismatch naming it and their offload namespaces differ."""
    from sluice.engine.core import EngineCore
    from sluice.engine.kv_transfer import PoolIdentity

    short, long = (EngineCore(EngineConfig.from_options(
        str(tiny_phi3_longrope_dir), num_kv_blocks=64, block_size=4, dtype="float32", **o))
        for o in ({"max_model_len": 32}, {}))
    ids = [PoolIdentity.of(c.kv_transfer.model, c.kv_transfer.pool) for c in (short, long)]
    assert ids[0].model.endswith("(longrope short factors)")
    assert ids[1].model.endswith("(longrope long factors)")
    mismatch = ids[1].mismatch(ids[0])
    assert mismatch is not None and "longrope short factors" in mismatch
    assert ids[0].namespace != ids[1].namespace


def test_dynamic_ntk_base_is_part_of_the_kv_identity(tiny_qwen2_dir: Path) -> None:
    """Dynamic NTK's base is raised for the context served: a worker within the original
    context rotates as the checkpoint does, one at the default (twice it) otherwise; its
    KV blocks' identity says which."""
    from sluice.engine.core import EngineCore
    from sluice.engine.kv_transfer import PoolIdentity

    dynamic = {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    plain, scaled = (EngineCore(EngineConfig.from_options(
        str(tiny_qwen2_dir), num_kv_blocks=64, block_size=4, dtype="float32",
        hf_overrides=dynamic, **o)) for o in ({"max_model_len": 2048}, {}))
    assert plain.runner.max_model_len == 2048 and scaled.runner.max_model_len == 4096
    ids = [PoolIdentity.of(c.kv_transfer.model, c.kv_transfer.pool) for c in (plain, scaled)]
    assert not ids[0].model.endswith(")") and ids[1].model.endswith("(dynamic NTK at 4096)")
    assert ids[1].mismatch(ids[0]) is not None
    tables = [c.runner.model.rope_cos for c in (plain, scaled)]
    assert tables[0] is not None and tables[1] is not None
    assert not torch.allclose(tables[0][100], tables[1][100])


def test_hf_overrides_add_yarn_to_a_checkpoint(tiny_qwen2_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`hf_overrides` (vLLM's `--hf-overrides`) replaces config.json's keys: Qwen's
    model-card YaRN on a checkpoint without it serves 4x the original context, from a dict
    (`LLM(hf_overrides={...})`) or the CLI's JSON text; bad JSON, a non-object and a GGUF
    file are refused naming `hf_overrides`."""
    from tiny_models import default_gguf_path

    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 2048}}
    r = runner(tiny_qwen2_dir, hf_overrides=yarn)
    assert r.model_config.rope.rope_type == "yarn" and r.max_model_len == 8192
    assert runner(tiny_qwen2_dir).max_model_len == 2048
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(InvalidRequestError) as err:
            EngineConfig.from_options(str(tiny_qwen2_dir), hf_overrides=bad)
        assert err.value.param == "hf_overrides"
    with pytest.raises(InvalidRequestError) as err:
        runner(default_gguf_path(), hf_overrides=yarn)
    assert err.value.param == "hf_overrides" and "GGUF" in str(err.value)
