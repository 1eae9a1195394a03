"""The runner of an encoder-only model (sluice.engine.models.bert: BERT, RoBERTa,
XLM-RoBERTa; sluice.engine.models.modernbert: ModernBERT; sluice.engine.models.nomic_bert:
NomicBERT; sluice.engine.models.gte: GTE's NewModel; GGUF files of BERT and NomicBERT:
sluice.engine.models.gguf_encoder): what `EngineCore` asks of
`ModelRunner`, without a KV cache, logits or a decode graph.

Every step's chunks are whole prompts (the core turns chunked prefill and prefix caching
off for this runner: a token's state depends on the tokens after it), encoded together
(one set of linears over all rows, attention per sequence) and pooled as the pooler
says (sluice.engine.pooling; without sentence-transformers files or `--pooler-config`,
CLS, normalized: what BERT-style embedding models are trained for, vLLM's default for
them); a token task (`/pooling`'s token_embed) keeps every token's row. A classifier's
row is its labels' logits (`classify` of the state its head reads: the first token's,
or ModernBERT's mean of all; each token's for token_classify), which the core turns into
scores; one with one label is a cross-encoder, to which the worker sends pairs for
`/v1/score` and `/v1/rerank`.
The block manager still counts blocks for the sequences, as it would for their KV, so
admission and `max_num_seqs` behave as for any model; none holds memory. Generation,
LoRA, speculative decoding, KV offload and quantization are refused.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sluice.engine.config import EngineConfig
from sluice.engine.model_runner import ModelRunner, SeqChunk, resolve_device
from sluice.engine.models.bert import ENCODER_ARCHITECTURES, load_encoder
from sluice.engine.models.gguf_encoder import (
    gguf_encoder_architecture,
    gguf_encoder_config,
    gguf_pooler,
    load_gguf_encoder,
)
from sluice.engine.models.gte import GTE_ARCHITECTURES, load_gte
from sluice.engine.models.loader import overridden, read_config
from sluice.engine.models.modernbert import MODERNBERT_ARCHITECTURES, load_modernbert
from sluice.engine.models.nomic_bert import NOMIC_BERT_ARCHITECTURES, load_nomic_bert
from sluice.engine.native import PackedLinear, cpu_linear
from sluice.engine.pooling import (
    TOKEN_LEVEL,
    Pooler,
    chunk_rows,
    parse_pooler_config,
    pooled_rows,
    resolve_pooler,
)
from sluice.engine.tokenizer import Tokenizer, default_served_name, load_tokenizer, local_model_path
from sluice.protocol.errors import InvalidRequestError

log = logging.getLogger(__name__)

# config.json's architecture -> its loader: (model, config) from a checkpoint directory
ENCODERS: dict[str, Callable[..., tuple[Any, Any]]] = {
    **dict.fromkeys(ENCODER_ARCHITECTURES, load_encoder),
    **dict.fromkeys(MODERNBERT_ARCHITECTURES, load_modernbert),
    **dict.fromkeys(NOMIC_BERT_ARCHITECTURES, load_nomic_bert),
    **dict.fromkeys(GTE_ARCHITECTURES, load_gte)}


def build_runner(config: EngineConfig) -> Any:
    """The runner for `config`'s model: an encoder's (a checkpoint directory's, or a
    GGUF file's), or the decoder's ModelRunner."""
    mc = config.model
    path = local_model_path(mc.model, mc.revision)
    if path.is_dir():
        hf_config = overridden(read_config(path), mc.overrides())
        if hf_config.get("architectures", [""])[0] in ENCODERS:
            return EncoderRunner(config, path, hf_config)
    elif gguf_encoder_architecture(path) is not None:
        return EncoderRunner(config, path, overridden(gguf_encoder_config(path), mc.overrides()))
    return ModelRunner(config)


class EncoderRunner:
    encoder_only = True  # EngineCore: no chunked prefill, no prefix caching, no generation
    rope_variant = ""

    def __init__(self, config: EngineConfig, path: Path, hf_config: dict[str, Any]) -> None:
        """`hf_config`: the checkpoint's config.json, `--hf-overrides` applied."""
        mc = config.model
        refused = [name for name, on in (
            ("enable_lora", config.lora.enable_lora),
            ("speculative_config", config.speculative is not None),
            ("kv_offload", config.cache.kv_offload is not None),
            ("kv_store", config.cache.kv_store is not None),
            ("quantization", mc.quantization != "none")) if on]
        if refused:
            raise InvalidRequestError(f"{refused[0]} is not supported for an encoder-only "
                                      "model", param=refused[0])
        self.device, self.dtype = resolve_device(mc)
        if self.device.type == "cpu" and mc.cpu_threads is not None:
            torch.set_num_threads(mc.cpu_threads)
        load = load_gguf_encoder if path.is_file() else ENCODERS[hf_config["architectures"][0]]
        self.encoder, self.model_config = load(path, hf_config, self.device, self.dtype)
        if cpu_linear(mc.kernel_backend, self.device, self.dtype) is not None:
            # oneDNN on weights packed once: 1.1-1.2x torch's MKL F.linear (docs/models.md)
            self.encoder.use_matmul(lambda weight: PackedLinear(weight, F.linear))
        self.tokenizer: Tokenizer = load_tokenizer(mc.tokenizer or mc.model, mc.revision)
        self.model_name: str = mc.served_model_name or default_served_name(mc.model)
        self.vocab_size = self.model_config.vocab_size
        limit = self.model_config.max_len
        if mc.max_model_len is not None and mc.max_model_len > limit:
            raise InvalidRequestError(f"max_model_len {mc.max_model_len} exceeds the model's "
                                      f"limit of {limit}", param="max_model_len")
        self.max_model_len = mc.max_model_len or limit
        self.block_size = config.cache.block_size
        full = -(-self.max_model_len // self.block_size)  # blocks of a longest prompt
        self.num_kv_blocks = config.cache.num_kv_blocks or config.scheduler.max_num_seqs * full
        self.kv_cache_bytes = 0
        self.labels = self.model_config.labels
        # a pair's second text starts after the first separator (two token types: BERT's)
        self.separator = self._separator() if self.labels else None
        if self.labels and mc.pooler_config is not None:
            raise InvalidRequestError("pooler_config does not apply to a classifier (its "
                                      "scores are its classifier's)", param="pooler_config")
        self.pooler = Pooler("CLS", False) if self.labels else resolve_pooler(
            path if path.is_dir() else None, parse_pooler_config(mc.pooler_config),
            default=(gguf_pooler(path) if path.is_file() else None) or Pooler("CLS", True))
        self.pooled: list[Tensor] | None = None
        log.info("%s: an encoder-only %s (%s pooling%s), %d tokens",
                 self.model_config.architecture,
                 f"classifier of {len(self.labels)} labels" if self.labels
                 else "embedding model",
                 self.pooler.pooling_type, ", normalized" if self.pooler.normalize else "",
                 self.max_model_len)
        self.execute([SeqChunk([0, 0], 0, [], True, pool=self.pooler.pooling_type)])  # warm-up

    def _separator(self) -> int | None:
        """The separator token's id (tokenizer_config.json's `sep_token`, else `[SEP]`)."""
        if self.tokenizer.sep_token_id is not None:
            return self.tokenizer.sep_token_id
        token = self.tokenizer.backend.token_to_id("[SEP]")
        return int(token) if token is not None else None

    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk]) -> Tensor:
        """Encode the chunks (whole prompts) and pool each into a row of `self.pooled`, in
        chunk order (`ModelRunner.execute`'s contract, with no logits rows)."""
        self.pooled = None
        empty = torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        if not chunks:
            return empty
        for c in chunks:  # (the core schedules nothing else for this runner)
            assert c.pool and not c.start_pos and c.need_logits, "whole prompts to pool only"
        hidden = self.encoder([c.token_ids for c in chunks], self.separator)
        if self.labels:
            self.pooled = self._classify(hidden, chunks)
            return empty
        starts = itertools.accumulate((len(c.token_ids) for c in chunks[:-1]), initial=0)
        rows, sizes = pooled_rows((start, len(c.token_ids), c.pool)
                                  for start, c in zip(starts, chunks, strict=True))
        states = hidden[torch.tensor(rows, device=self.device)]
        self.pooled = chunk_rows(states.float(), sizes, [c.pool for c in chunks])
        return empty

    def _classify(self, hidden: Tensor, chunks: list[SeqChunk]) -> list[Tensor]:
        """A classifier's logits for each chunk: of the state its head reads (the first
        token's, or the mean of all: `classifier_pooling`), or of each token's state for
        a token task (one row a token)."""
        mean = self.encoder.classifier_pooling == "mean"
        inputs = []
        for c, states in zip(chunks, hidden.split([len(c.token_ids) for c in chunks]),
                             strict=True):
            inputs.append(states if c.pool == TOKEN_LEVEL else
                          states.mean(0, keepdim=True) if mean else states[:1])
        logits = self.encoder.classify(torch.cat(inputs)).split([len(x) for x in inputs])
        return [rows if c.pool == TOKEN_LEVEL else rows[0]
                for c, rows in zip(chunks, logits, strict=True)]
