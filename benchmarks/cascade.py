"""The cascade's escalation rules on the labelled prompt set shipped with the router.

    python benchmarks/cascade.py --train     # refit router/data/cascade_classifier.json
    python benchmarks/cascade.py             # evaluate on the test split

The set (`src/sluice/router/data/cascade_prompts.jsonl`): 100 prompts labelled easy
(short lookups, greetings, arithmetic) or hard (proofs, code, design, multi-step
reasoning), split 75/25 train/test. The hard and easy prompts come from templates,
and the test split shares templates with the training split, so the test accuracy is
an upper bound for prompts unlike these.

What it reports, on the test split, for the rule `classifier P(hard) >= 0.5` (and,
for comparison, `prompt longer than 12 words`):

    share escalated   prompts the cascade sends to the large model
    quality kept      hard prompts that reach the large model (a hard prompt answered
                      by the small model counts as lost; an easy one is fine on either)
    cost saved        vs always-large, with the large model 10x the small one's price
                      per token and every answer the same length; prompt rules run
                      before the small model, so an escalated prompt costs only the
                      large model

The confidence rule (the small model's mean token logprob) needs a real small *and*
large model to judge; with one real model here it is tested on constructed cases
(tests/router/test_cascade.py) rather than measured. Last line: one JSON document.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sluice.router.cascade import BUILTIN, Classifier  # noqa: E402

DATA = ROOT / "src" / "sluice" / "router" / "data" / "cascade_prompts.jsonl"
PRICE_RATIO = 10.0


def load() -> list[dict[str, str]]:
    return [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]


def evaluate(name: str, rows: list[dict[str, str]], escalate: list[bool]) -> dict[str, float]:
    hard = [r["label"] == "hard" for r in rows]
    n = len(rows)
    share = sum(escalate) / n
    kept = sum(e for e, h in zip(escalate, hard, strict=True) if h) / max(1, sum(hard))
    correct = sum(e == h for e, h in zip(escalate, hard, strict=True)) / n
    cost = sum(PRICE_RATIO if e else 1.0 for e in escalate) / (PRICE_RATIO * n)
    out = {"rule": name, "prompts": n, "share_escalated": round(share, 3),
           "quality_kept": round(kept, 3), "label_accuracy": round(correct, 3),
           "cost_saved": round(1.0 - cost, 3)}
    print(f"{name:<28} escalated {share:6.1%}  hard kept {kept:6.1%}  "
          f"accuracy {correct:6.1%}  cost saved vs always-large {1 - cost:6.1%}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", action="store_true", help="refit and write the classifier")
    args = ap.parse_args()
    rows = load()
    train = [r for r in rows if r["split"] == "train"]
    test = [r for r in rows if r["split"] == "test"]
    if args.train:
        model = Classifier.train([(r["prompt"], int(r["label"] == "hard")) for r in train])
        BUILTIN.write_text(model.to_json() + "\n")
        print(f"wrote {BUILTIN} ({model.dim} weights, {len(train)} training prompts)")
    model = Classifier.load("builtin")
    results = [
        evaluate("classifier p>=0.5", test, [model.p_hard(r["prompt"]) >= 0.5 for r in test]),
        evaluate("length > 12 words", test, [len(r["prompt"].split()) > 12 for r in test]),
        evaluate("always large", test, [True] * len(test)),
        evaluate("always small", test, [False] * len(test)),
    ]
    print(json.dumps({"benchmark": "cascade", "split": "test", "price_ratio": PRICE_RATIO,
                      "results": results}))


if __name__ == "__main__":
    main()
