"""lm-evaluation-harness against a sluice worker and against its own transformers backend,
same weights, same run: the scores an evaluation harness reads through sluice's
completions API (`echo` with `logprobs`, docs/worker.md "Scoring a prompt") are the
model's.

    flock /tmp/sluice-heavy.lock .venv/bin/python benchmarks/lm_eval_scores.py \\
        --lm-eval /tmp/lmeval/bin/lm_eval --model /tmp/smollm2-hf

`--lm-eval`: the `lm_eval` command of a venv of its own (a peer, never a dependency:
`python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install torch==2.13.0 &&
/tmp/lmeval/bin/pip install "lm_eval[api,hf]"`). `--model`: a transformers directory
both sides load in float32 (the default model's float32 copy: docs/bench.md, "sluice
vs vLLM"). The task is written here (twenty short facts, context + continuation, no
download): a loglikelihood task scored by accuracy (is the continuation the greedy one)
and perplexity. lm-eval's `local-completions` sends token ids, `echo`, `logprobs: 1`,
`max_tokens: 1`. Prints both tables' numbers, the largest per-sample difference in
loglikelihood and whether every greedy flag agrees; the last stdout line is one JSON
document.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

from sluice.control.local import LocalWorkerPool

FACTS = [("The capital of France is", " Paris"), ("The capital of Germany is", " Berlin"),
         ("Water freezes at zero degrees", " Celsius"), ("The sun rises in the", " east"),
         ("One, two, three, four,", " five"), ("Monday, Tuesday, Wednesday,", " Thursday"),
         ("The opposite of hot is", " cold"), ("Cats and", " dogs"),
         ("The largest planet in our solar system is", " Jupiter"),
         ("Bread is made from", " flour"), ("The color of the sky on a clear day is", " blue"),
         ("Shakespeare wrote Romeo and", " Juliet"), ("Two plus two equals", " four"),
         ("The first letter of the alphabet is", " A"), ("January, February,", " March"),
         ("Ice is frozen", " water"), ("The Eiffel Tower is in", " Paris"),
         ("A week has seven", " days"), ("Bees make", " honey"),
         ("The chemical symbol for water is", " H2O")]

TASK = """task: sluice_facts
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(folder: str) -> None:
    data = os.path.join(folder, "facts.jsonl")
    with open(data, "w") as f:
        for context, continuation in FACTS:
            f.write(json.dumps({"context": context, "continuation": continuation}) + "\n")
    with open(os.path.join(folder, "sluice_facts.yaml"), "w") as f:
        f.write(TASK.format(data=data))


def run_lm_eval(lm_eval: str, folder: str, name: str, model_args: list[str]) -> dict:
    """One lm_eval run; its metrics and {doc_id: (loglikelihood, is_greedy)}."""
    out = os.path.join(folder, "out-" + name)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([lm_eval, *model_args, "--tasks", "sluice_facts", "--include_path",
                           folder, "--output_path", out, "--log_samples"],
                          capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"lm_eval ({name}) failed:\n{proc.stderr[-3000:]}")
    results = json.load(open(glob.glob(os.path.join(out, "**", "results_*.json"),
                                       recursive=True)[0]))["results"]["sluice_facts"]
    samples = {}
    for line in open(glob.glob(os.path.join(out, "**", "samples_*.jsonl"), recursive=True)[0]):
        s = json.loads(line)
        ll, greedy = s["resps"][0][0]
        samples[s["doc_id"]] = (float(ll), str(greedy) == "True")
    return {"acc": results["acc,none"], "perplexity": results["perplexity,none"],
            "samples": samples}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lm-eval", required=True, help="the lm_eval command (its own venv)")
    ap.add_argument("--model", required=True, help="a transformers model directory")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sluice-lm-eval-") as folder:
        write_task(folder)
        pool = LocalWorkerPool(1, ["--model", args.model, "--dtype", "float32",
                                   "--served-model-name", "scored"], log_dir=folder)
        url = pool.start()[0].url
        try:
            print("# lm_eval local-completions against sluice worker", file=sys.stderr)
            sluice = run_lm_eval(args.lm_eval, folder, "sluice", [
                "--model", "local-completions", "--model_args",
                f"model=scored,base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={args.model},tokenized_requests=True,num_concurrent=1,"
                "max_retries=1"])
        finally:
            pool.stop()
        print("# lm_eval hf (transformers) on the same weights", file=sys.stderr)
        hf = run_lm_eval(args.lm_eval, folder, "hf", [
            "--model", "hf", "--model_args", f"pretrained={args.model},dtype=float32",
            "--device", "cpu"])
    diff = max(abs(sluice["samples"][k][0] - hf["samples"][k][0]) for k in hf["samples"])
    same_greedy = all(sluice["samples"][k][1] == hf["samples"][k][1] for k in hf["samples"])
    print(f"{'backend':<10}{'acc':>8}{'perplexity':>12}")
    for name, r in (("sluice", sluice), ("hf", hf)):
        print(f"{name:<10}{r['acc']:>8.4f}{r['perplexity']:>12.4f}")
    print(f"max |loglikelihood difference| {diff:.2e}; greedy flags agree: {same_greedy}")
    print(json.dumps({"benchmark": "lm_eval_scores", "samples": len(hf["samples"]),
                      "sluice": {"acc": sluice["acc"], "perplexity": sluice["perplexity"]},
                      "hf": {"acc": hf["acc"], "perplexity": hf["perplexity"]},
                      "max_abs_loglikelihood_diff": diff, "greedy_agree": same_greedy}))
    return 0 if same_greedy else 1


if __name__ == "__main__":
    sys.exit(main())
