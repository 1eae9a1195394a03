"""LoRA adapters made with peft for tests and the LoRA benchmark (no hub, no network).

`make_adapter(base_dir, out, r=..., alpha=..., targets=..., seed=...)` writes a PEFT
adapter directory for the Hugging Face checkpoint in `base_dir`, with random A *and* B
(`init_lora_weights=False`; PEFT's default B = 0 would leave the model unchanged), so
that an adapter really changes the outputs. `merge_adapter` writes the base model with
the adapter merged in (peft's `merge_and_unload`), the reference an adapter's outputs
must equal.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def make_adapter(base_dir: Path, out: Path, *, r: int = 8, alpha: float = 16,
                 targets: Sequence[str] = ALL_TARGETS, seed: int = 0, rslora: bool = False,
                 scale: float = 1.0) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        init_lora_weights=False, use_rslora=rslora)
    model = get_peft_model(base, config)
    if scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(scale)
    model.save_pretrained(str(out))
    return out


def merge_adapter(base_dir: Path, adapter_dir: Path, out: Path) -> Path:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(out), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (base_dir / name).exists():
            shutil.copy(base_dir / name, out / name)
    return out
