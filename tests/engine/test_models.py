"""Model loading: config parsing (both transformers config styles, RoPE scaling), clear
errors for unsupported or incomplete checkpoints, llama.cpp's Q/K permutation, an untied
Mistral checkpoint, bf16, KV pool sizing, and the real default GGUF against transformers."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from sluice.engine.config import CacheConfig, EngineConfig
from sluice.engine.model_runner import ModelRunner, SeqChunk, kv_pool_blocks
from sluice.engine.models.gguf_file import GGUFFile, read_gguf
from sluice.engine.models.gguf_loader import config_from_gguf, unpermute_qk
from sluice.engine.models.llama import RopeConfig, inv_frequencies
from sluice.engine.models.loader import UnsupportedModelError, config_from_hf, load_model
from sluice.engine.tokenizer import ModelNotFoundError
from sluice.protocol.errors import InvalidRequestError

CPU = torch.device("cpu")


def copy_checkpoint(src: Path, dst: Path, **config_changes: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(config_changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_unsupported_architecture_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    bad = copy_checkpoint(tiny_llama_dir, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as info:
        load_model(str(bad), CPU, torch.float32)
    assert info.value.status_code == 400 and info.value.param == "model"


def test_missing_files_are_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    no_config = copy_checkpoint(tiny_llama_dir, tmp_path / "a")
    (no_config / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(str(no_config), CPU, torch.float32)
    no_weights = copy_checkpoint(tiny_llama_dir, tmp_path / "b")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(str(no_weights), CPU, torch.float32)
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        load_model(str(tmp_path / "no-such-model"), CPU, torch.float32)


def test_missing_tensor_is_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    ckpt = copy_checkpoint(tiny_llama_dir, tmp_path / "c")
    weights = load_file(str(ckpt / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(ckpt / "model.safetensors"))
    with pytest.raises(InvalidRequestError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(ckpt), CPU, torch.float32)


def base_config(**extra: object) -> dict[str, object]:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 256,
            "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 8192, **extra}


def test_both_config_styles_give_the_same_rope() -> None:
    old = config_from_hf(base_config(rope_theta=500000.0,
                                     rope_scaling={"type": "linear", "factor": 4.0}))
    new = config_from_hf(base_config(rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                      "rope_theta": 500000.0}))
    assert old.rope == new.rope == RopeConfig(500000.0, "linear", {"factor": 4.0})
    assert config_from_hf(base_config()).rope == RopeConfig(10000.0, "default", {})
    assert config_from_hf(base_config(head_dim=32)).head_dim == 32


def test_unknown_rope_type_is_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="'su-perscaled'"):
        config_from_hf(base_config(rope_scaling={"rope_type": "su-perscaled", "factor": 2.0}))


@pytest.mark.parametrize("params", [
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 1024, "rope_theta": 500000.0},
])
def test_rope_frequencies_match_transformers(params: dict[str, object]) -> None:
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = HFLlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=8192,
                           rope_parameters=dict(params))
    want, scale = ROPE_INIT_FUNCTIONS[str(params["rope_type"])](hf_cfg, "cpu")
    cfg = config_from_hf(base_config(rope_parameters=dict(params)))
    got, got_scale = inv_frequencies(cfg.rope, cfg.rotary_dim, 8192)
    assert got_scale == scale == 1.0
    torch.testing.assert_close(got, want.float())


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:  # convert_hf_to_gguf.py
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
            .reshape(w.shape)

    w = torch.randn(3 * 64, 40)
    assert torch.equal(unpermute_qk(llama_cpp_permute(w, 3), 3), w)
    assert not torch.equal(llama_cpp_permute(w, 3), w)


def make_tiny_mistral(out: Path, tokenizer_from: Path) -> Path:
    """Like tests/tiny_models.py, but reusing a built tokenizer (no second GGUF conversion)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "mistral", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        sliding_window=1024, tie_word_embeddings=False, eos_token_id=2)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_from / name, out / name)
    return out


def test_untied_mistral_checkpoint_and_bf16(tmp_path: Path, tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    ckpt = make_tiny_mistral(tmp_path / "tiny-mistral", tiny_llama_dir)
    runner = ModelRunner(EngineConfig.from_options(str(ckpt), num_kv_blocks=16, block_size=8,
                                                   dtype="float32"))  # auto: bf16 on AMX CPUs
    assert runner.model_config.architecture == "MistralForCausalLM"
    assert not runner.model_config.tie_word_embeddings
    assert runner.max_model_len == 1024  # capped by the sliding window
    ids = runner.tokenizer.encode("Mistral says hello to the world")
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)(
            torch.tensor([ids])).logits[0, -1]
    got = runner.execute([SeqChunk(ids, 0, [3, 5], True)])[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    bf16 = ModelRunner(EngineConfig.from_options(str(ckpt), num_kv_blocks=16, block_size=8,
                                                 dtype="bfloat16"))
    assert bf16.dtype == torch.bfloat16
    got16 = bf16.execute([SeqChunk(ids[:4], 0, [1, 2], False)])
    got16 = bf16.execute([SeqChunk(ids[4:], 4, [1, 2], True)])[0]
    assert got16.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(got16, want, dim=0) > 0.99


def test_kv_pool_sizing() -> None:
    assert kv_pool_blocks(CacheConfig(num_kv_blocks=7), 1000, CPU) == 7
    assert kv_pool_blocks(CacheConfig(kv_cache_memory_bytes=10_500), 1000, CPU) == 10
    ram_share = kv_pool_blocks(CacheConfig(cpu_kv_cache_fraction=0.01), 1 << 20, CPU)
    capped = kv_pool_blocks(CacheConfig(cpu_kv_cache_fraction=1.0), 1 << 20, CPU)
    assert 1 <= ram_share <= capped == 4096  # 4 GiB cap of 1 MiB blocks
    with pytest.raises(InvalidRequestError, match="smaller than one block"):
        kv_pool_blocks(CacheConfig(kv_cache_memory_bytes=10), 1000, CPU)


def test_max_model_len(tiny_llama_dir: Path) -> None:
    runner = ModelRunner(EngineConfig.from_options(str(tiny_llama_dir), num_kv_blocks=4,
                                                   max_model_len=64, served_model_name="m"))
    assert runner.max_model_len == 64 and runner.model_name == "m"
    with pytest.raises(InvalidRequestError, match="max_model_len") as info:
        ModelRunner(EngineConfig.from_options(str(tiny_llama_dir), num_kv_blocks=4,
                                              max_model_len=4096))
    assert info.value.param == "max_model_len"


def test_gguf_config_from_metadata(default_gguf: Path) -> None:
    cfg, permuted = config_from_gguf(GGUFFile(default_gguf))
    assert permuted and cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.head_dim, cfg.max_position_embeddings) == (49152, 64, 8192)
    assert cfg.tie_word_embeddings and cfg.rope.theta == 100000.0


def tiny_gguf(path: Path, arch: str) -> Path:
    """A GGUF v3 header with one string key and no tensors."""
    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + string("general.architecture")
                     + struct.pack("<I", 8) + string(arch))
    return path


def test_read_gguf_is_shared_until_the_file_changes(tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path / "m.gguf", "llama")
    first = read_gguf(path)
    assert read_gguf(path) is first and first.get("general.architecture") == "llama"
    tiny_gguf(tmp_path / "new.gguf", "qwen2").replace(path)  # a new file at the same path
    assert read_gguf(path).get("general.architecture") == "qwen2"


@pytest.mark.parametrize("cut", [4, 100, 5000])
def test_a_truncated_gguf_is_an_error_naming_it(default_gguf: Path, tmp_path: Path,
                                                cut: int) -> None:
    broken = tmp_path / "broken.gguf"
    with open(default_gguf, "rb") as f:
        broken.write_bytes(f.read(cut))
    with pytest.raises(InvalidRequestError) as err:
        GGUFFile(broken)
    assert err.value.param == "model" and "broken.gguf" in str(err.value)


@pytest.mark.model
def test_default_gguf_greedy_tokens_match_transformers(default_gguf: Path) -> None:
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(EngineConfig.from_options(None, num_kv_blocks=32, dtype="float32"))
    hf = AutoModelForCausalLM.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name,
                                              dtype=torch.float32).eval()
    tok = runner.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
               "The three primary colors are"]
    for first_block, prompt in zip((0, 16), prompts, strict=True):
        ids = tok.encode(prompt)
        table = list(range(first_block, first_block + 16))
        ours = runner.execute([SeqChunk(ids, 0, table, True)])
        generated = []
        for _ in range(6):
            generated.append(int(ours[0].argmax()))
            ours = runner.execute([SeqChunk(generated[-1:], len(ids) + len(generated) - 1,
                                            table, True)])
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):]
        assert generated == want.tolist()
