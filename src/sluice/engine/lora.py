"""Multi-LoRA serving: PEFT adapters applied per sequence in mixed batches.

An adapter is a PEFT directory (`adapter_config.json` + `adapter_model.safetensors`)
with low-rank pairs `A [r, in]`, `B [out, r]` for some of q/k/v/o/gate/up/down; a
sequence that uses it computes `y = x W^T + scaling * (x A^T) B^T` in each targeted
linear. Three pieces, as vLLM's (Punica/S-LoRA) design has them:

- `read_adapter` (no torch): checks a directory against the base model's shapes and
  `max_lora_rank` and returns its `AdapterMeta`, with a *content hash* of the weights
  and the config values that change outputs. The prefix cache is keyed by that hash,
  so two adapters never share KV and the same weights under two names do.
- `LoRACache` (the core): an LRU of `max_cpu_loras` loaded adapters (host memory).
- `LoRASlots` (the runner): `max_loras` slots of stacked weights per layer. Each
  step, the step's adapters get slots (least recently used slots not needed this step
  are reused) and every targeted linear adds, for the step's decode rows (one token
  each, flattened first)

      h = (x @ A_stack^T) * one_hot(row slot)     # [decodes, parts * max_loras * r]
      y[:, part] += h[:, part] @ B_part            # one addmm per fused part

  one shrink and one expand per part for all decodes, whatever their mix of adapters
  (Punica's BGMV, as dense products: on CPU a gather of per-row weights costs more
  than the zeros); and for each prefill chunk with an adapter, the same two products
  with that adapter's slot only (SGMV's segments). Base rows get an all-zero mask
  (their output is exactly the base one), and a step with no adapter row skips it
  all. Ranks below `max_lora_rank` are zero-padded and the scaling is folded into B
  when the adapter is loaded.

The scheduler keeps at most `max_loras` distinct adapters among running sequences, so a
step's adapters always fit in the slots.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice.protocol.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch
    from torch import Tensor

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT module name -> (this model's fused linear, part index within it)
TARGET_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
# PEFT modules of checkpoints that fuse them (Phi-3's qkv_proj and gate_up_proj, GLM's
# gate_up_proj): one A for the parts, B's rows the parts' outputs in order
FUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_SUBMODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
              "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
              "qkv_proj": "self_attn", "gate_up_proj": "mlp"}
_SUPPORTED = (*TARGET_MODULES, *FUSED_TARGETS)
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """Which adapter a request uses (vLLM's `LoRARequest`, by name and path).

    `content_hash`: what the front end found when it registered the adapter; the core
    refuses the request if the files changed since ("" = not checked)."""

    lora_name: str
    lora_path: str
    content_hash: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise _bad(f"lora_name must be a non-empty string, got {self.lora_name!r}",
                       "lora_name")
        if isinstance(self.lora_path, os.PathLike):
            object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
        if not isinstance(self.lora_path, str) or not isinstance(self.content_hash, str):
            # vLLM's LoRARequest(name, int_id, path) put the id here and the path after
            raise _bad(f"lora_path must be a path, got {self.lora_path!r}: sluice's "
                       "LoRARequest is LoRARequest(lora_name, lora_path), with no "
                       "lora_int_id (adapters are told apart by their weights' hash)")


@dataclass(frozen=True, slots=True)
class AdapterMeta:
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    content_hash: str  # hex sha256 of the weights file and the scaling
    base_model: str | None  # `base_model_name_or_path` as PEFT wrote it


def module_shapes(hidden: int, intermediate: int, q_size: int, kv_size: int,
                  gated: bool = True, mlp: bool = True) -> dict[str, tuple[int, int]]:
    """(in, out) features of each targetable linear (`gated`: the MLP has a gate_proj;
    Arcee's has up_proj alone; `mlp`: the MLP's linears are targets, not a mixture of
    experts' whose adapters are the attention's alone)."""
    shapes = {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size),
              "v_proj": (hidden, kv_size), "o_proj": (q_size, hidden)}
    if mlp:
        shapes |= {"gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
                   "down_proj": (intermediate, hidden)}
        if not gated:
            del shapes["gate_proj"]
    return shapes


def fused_parts(shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[str, ...]]:
    """FUSED_PARTS of a model's targets (`module_shapes`): Arcee's w13 is up_proj alone, a
    mixture of experts has the attention's alone."""
    fused = {name: tuple(m for m in parts if m in shapes) for name, parts in FUSED_PARTS.items()}
    return {name: parts for name, parts in fused.items() if parts}


def _bad(message: str, param: str = "lora_path") -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _tensor_key(name: str) -> tuple[int, str, str]:
    """`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` -> (3, q_proj, A)."""
    parts = name.split(".")
    try:
        i = parts.index("layers")
        layer, module, ab = int(parts[i + 1]), parts[i + 3], parts[i + 4]
    except (ValueError, IndexError):
        raise _bad(f"unexpected tensor {name!r} in the adapter (only LoRA A/B weights of "
                   f"{', '.join(_SUPPORTED)} are supported)") from None
    if module not in _SUPPORTED or ab not in ("lora_A", "lora_B") \
            or parts[i + 2] != _SUBMODULE[module] or parts[-1] != "weight":
        raise _bad(f"unexpected tensor {name!r} in the adapter (only LoRA A/B weights of "
                   f"{', '.join(_SUPPORTED)} are supported)")
    return layer, module, ab[-1]


def _read_header(data: bytes, path: str) -> dict[str, Any]:
    try:
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + length])
    except (struct.error, ValueError):
        raise _bad(f"{path} is not a safetensors file") from None
    if not isinstance(header, dict):
        raise _bad(f"{path} is not a safetensors file")
    header.pop("__metadata__", None)
    return header


def read_adapter(path: str, shapes: Mapping[str, Sequence[int]], num_layers: int,
                 max_rank: int) -> tuple[AdapterMeta, bytes]:
    """Check a PEFT adapter directory against the base model; its meta and the raw bytes
    of its weights file. Raises `InvalidRequestError` (param `lora_path`) naming what is
    wrong: a missing file, an unsupported option or module, a rank over `max_rank`, a
    tensor whose shape is not this base model's."""
    config_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isdir(path):
        raise _bad(f"LoRA adapter directory {path!r} does not exist")
    for f in (config_path, weights_path):
        if not os.path.isfile(f):
            raise _bad(f"LoRA adapter {path!r} has no {os.path.basename(f)}")
    try:
        with open(config_path, encoding="utf-8") as fh:
            config = json.load(fh)
        with open(weights_path, "rb") as fh:
            data = fh.read()
    except (OSError, ValueError) as exc:
        raise _bad(f"cannot read LoRA adapter {path!r}: {exc}") from None
    if not isinstance(config, dict):
        raise _bad(f"{config_path} is not a JSON object")
    meta = _check_config(config, path, max_rank)
    header = _read_header(data, weights_path)
    seen: set[str] = set()
    owner: dict[tuple[int, str], str] = {}  # (layer, part) -> the module giving its A and B
    for name, info in header.items():
        layer, module, ab = _tensor_key(name)
        if not 0 <= layer < num_layers:
            raise _bad(f"adapter tensor {name!r} is for layer {layer}, but the base model has "
                       f"{num_layers} layers (an adapter for another base model?)")
        parts = FUSED_TARGETS.get(module, (module,))
        if any(m not in shapes for m in parts):
            raise _bad(f"adapter tensor {name!r} is for {module}, not a LoRA target of this "
                       f"base model (its targets: {', '.join(shapes)})")
        d_in, d_out = shapes[parts[0]][0], sum(shapes[m][1] for m in parts)
        want = [meta.rank, d_in] if ab == "A" else [d_out, meta.rank]
        if list(info.get("shape", [])) != want or info.get("dtype") not in _DTYPE_BYTES:
            raise _bad(f"adapter tensor {name!r} has shape {info.get('shape')} "
                       f"({info.get('dtype')}), but this base model needs {want} (float): "
                       "an adapter for another base model?")
        seen.update(parts)
        for part in parts:  # a part from one tensor pair only: fused or on its own
            if owner.setdefault((layer, part), module) != module:
                both = " and ".join(sorted((owner[(layer, part)], module)))
                raise _bad(f"adapter {path!r} has both {both} for {part} in layer {layer}")
    if not seen:
        raise _bad(f"LoRA adapter {path!r} has no LoRA weights")
    digest = hashlib.sha256(data)
    digest.update(struct.pack("<d", meta.scaling))
    return AdapterMeta(meta.rank, meta.scaling, tuple(sorted(seen)), digest.hexdigest(),
                       meta.base_model), data


def _check_config(config: dict[str, Any], path: str, max_rank: int) -> AdapterMeta:
    if config.get("peft_type", "LORA") != "LORA":
        raise _bad(f"adapter {path!r} is {config.get('peft_type')!r}, not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise _bad(f"adapter {path!r} has an invalid rank r={rank!r}")
    if rank > max_rank:
        raise _bad(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}.")
    for key, ok in (("bias", ("none", None)), ("use_dora", (False, None)),
                    ("fan_in_fan_out", (False, None)), ("modules_to_save", (None, [])),
                    ("rank_pattern", ({}, None)), ("alpha_pattern", ({}, None)),
                    ("layers_to_transform", (None,))):
        if config.get(key) not in ok:
            raise _bad(f"adapter {path!r}: {key}={config.get(key)!r} is not supported")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    unexpected = [t for t in names if t not in _SUPPORTED]
    if isinstance(targets, str) and targets in ("all-linear",):
        unexpected = []
    if unexpected:
        raise _bad(f"While loading {path}, expected target modules in "
                   f"{list(_SUPPORTED)} but received {unexpected}. Please verify that "
                   "the loaded LoRA module is correct")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float):
        raise _bad(f"adapter {path!r} has an invalid lora_alpha {alpha!r}")
    scaling = alpha / (rank ** 0.5 if config.get("use_rslora") else rank)
    base = config.get("base_model_name_or_path")
    return AdapterMeta(rank, float(scaling), (), "", base if isinstance(base, str) else None)


# --------------------------------------------------------------------------- torch side


@dataclass(frozen=True)
class LoRAAdapter:
    """Loaded weights: `(layer, module) -> (A [r, in], B*scaling [out, r])`, float32."""

    meta: AdapterMeta
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]]

    @property
    def key(self) -> str:
        return self.meta.content_hash


def load_adapter(path: str, shapes: Mapping[str, Sequence[int]], num_layers: int,
                 max_rank: int, output_scales: Mapping[str, float] | None = None,
                 output_rows: Mapping[str, Tensor] | None = None) -> LoRAAdapter:
    """`read_adapter`, then the tensors (float32, scaling folded into B, and a module's
    `output_scales` entry: what the model folded into that module's weights, Granite's
    multipliers; a module's B rows in its `output_rows` order: the order the model put
    that module's weight rows in, GLM's Q and K heads)."""
    from safetensors.torch import load as load_safetensors

    meta, data = read_adapter(path, shapes, num_layers, max_rank)
    tensors = load_safetensors(data)
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
    pairs: dict[tuple[int, str], dict[str, Tensor]] = {}
    for name, t in tensors.items():
        layer, module, ab = _tensor_key(name)
        pairs.setdefault((layer, module), {})[ab] = t.float()
    for key, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise _bad(f"adapter {path!r} has lora_A without lora_B (or the reverse) for "
                       f"layer {key[0]} {key[1]}")
        layer, module = key
        start = 0
        for part in FUSED_TARGETS.get(module, (module,)):  # a fused module's B, split
            out = shapes[part][1]
            scale = meta.scaling * (output_scales or {}).get(part, 1.0)
            b = pair["B"][start:start + out] * scale
            start += out
            rows = (output_rows or {}).get(part)
            weights[(layer, part)] = (pair["A"].contiguous(),
                                      (b if rows is None else b[rows]).contiguous())
    return LoRAAdapter(meta, weights)


class LoRACache:
    """Host LRU of loaded adapters (`max_cpu_loras`), keyed by name and checked by hash."""

    def __init__(self, capacity: int, loader: Callable[[str], LoRAAdapter]) -> None:
        self.capacity = capacity
        self._load = loader
        self._by_name: OrderedDict[tuple[str, str], LoRAAdapter] = OrderedDict()
        self.loads = 0  # adapters read from disk (cumulative)

    def get(self, req: LoRARequest) -> LoRAAdapter:
        key = (req.lora_name, req.lora_path)
        adapter = self._by_name.get(key)
        if adapter is None:
            adapter = self._load(req.lora_path)
            self.loads += 1
            self._by_name[key] = adapter
            while len(self._by_name) > self.capacity:
                self._by_name.popitem(last=False)
        else:
            self._by_name.move_to_end(key)
        if req.content_hash and req.content_hash != adapter.key:
            self._by_name.pop(key, None)
            raise _bad(f"the files of LoRA adapter {req.lora_name!r} changed since it was "
                       "loaded; load it again", param="model")
        return adapter

    def forget(self, req: LoRARequest) -> None:
        self._by_name.pop((req.lora_name, req.lora_path), None)


class StepLoRA:
    """One step's LoRA layout, shared by every LoRA linear (set by the runner):

    - `dense_rows`: the leading single-token rows (decodes), computed together against
      every slot's weights, each row masked to its own slot (`mask`); 0: none has an
      adapter.
    - `segments`: (start, end, slot) row ranges of prefill chunks with an adapter, each
      computed with its own adapter's weights only (a chunk has many rows, so the
      all-slots product would multiply the LoRA FLOPs by `max_loras`).
    """

    def __init__(self, kernel: Callable[..., None] | None = None) -> None:
        self.kernel = kernel  # the native per-row kernel (native.lora_bgmv), or None
        self.dense_rows = 0
        self.mask: dict[int, Tensor] = {}  # parts -> [dense_rows, parts * max_loras * r]
        self.row_slots: Tensor | None = None  # [dense_rows] int64, -1 = base (the kernel's)
        self.segments: list[tuple[int, int, int]] = []


class LoRALinear:
    """The LoRA side of one fused linear, for every slot: A stacked part-major
    (`a[(part * max_loras + slot) * r + j]`, rows of `in` features) and one B per part
    (`b[part][slot * r + j]`); `__call__(x, y)` adds the step's deltas to `y` in place."""

    def __init__(self, parts: Sequence[tuple[int, int]], out_offsets: Sequence[int],
                 d_in: int, max_loras: int, rank: int, step: StepLoRA,
                 device: torch.device, dtype: torch.dtype) -> None:
        import torch

        self.parts = len(parts)
        self.rank = rank
        self.slots = max_loras
        self.step = step
        self.out_cols = [(lo, lo + out) for lo, (_, out) in zip(out_offsets, parts, strict=True)]
        self.offsets = [lo for lo, _ in self.out_cols]
        self.a = torch.zeros(self.parts * max_loras * rank, d_in, device=device, dtype=dtype)
        self.b = [torch.zeros(max_loras * rank, out, device=device, dtype=dtype)
                  for _, out in parts]

    def _a_rows(self, part: int, slot: int) -> slice:
        lo = (part * self.slots + slot) * self.rank
        return slice(lo, lo + self.rank)

    def set_slot(self, slot: int, pairs: Sequence[tuple[Tensor, Tensor] | None]) -> None:
        """Write one adapter's (A, B) per part into `slot` (None: part not targeted)."""
        r = self.rank
        for i, pair in enumerate(pairs):
            a_rows = self.a[self._a_rows(i, slot)]
            b_rows = self.b[i][slot * r:(slot + 1) * r]
            a_rows.zero_()
            b_rows.zero_()
            if pair is not None:
                a, b = pair
                a_rows[:a.shape[0]] = a
                b_rows[:a.shape[0]] = b.t()

    def __call__(self, x: Tensor, y: Tensor) -> None:
        step = self.step
        width = self.slots * self.rank
        if step.dense_rows and step.kernel is not None:
            step.kernel(x[:step.dense_rows].contiguous(), y, self.a, self.b, step.row_slots,
                        self.rank, self.slots, self.offsets)
        elif step.dense_rows:
            d = step.dense_rows
            h = x[:d] @ self.a.t()
            h.mul_(step.mask[self.parts])
            for i, (lo, hi) in enumerate(self.out_cols):
                y[:d, lo:hi].addmm_(h[:, i * width:(i + 1) * width], self.b[i])
        r = self.rank
        for start, end, slot in step.segments:
            xs = x[start:end]
            for i, (lo, hi) in enumerate(self.out_cols):
                h = xs @ self.a[self._a_rows(i, slot)].t()
                y[start:end, lo:hi].addmm_(h, self.b[i][slot * r:(slot + 1) * r])


class LoRASlots:
    """`max_loras` slots of adapter weights inside the model's linears (the runner's)."""

    def __init__(self, linears: Sequence[dict[str, LoRALinear]], max_loras: int, rank: int,
                 step: StepLoRA, parts: Mapping[str, tuple[str, ...]] = FUSED_PARTS) -> None:
        self.linears = linears  # per layer: "qkv" | "o" | "gate_up" | "down" -> LoRALinear
        self.parts = parts  # each fused linear's modules (`fused_parts`)
        self.max_loras = max_loras
        self.rank = rank
        self.step = step
        self.slots: list[str | None] = [None] * max_loras  # adapter key per slot
        self._lru: OrderedDict[int, None] = OrderedDict()  # slot ids, least recent first
        self.loads = 0

    def _assign(self, adapter: LoRAAdapter, needed: set[str]) -> int:
        if adapter.key in self.slots:
            slot = self.slots.index(adapter.key)
        else:
            free = [i for i, k in enumerate(self.slots) if k is None]
            if free:
                slot = free[0]
            else:  # the least recently used slot this step does not need
                slot = next(i for i in self._lru if self.slots[i] not in needed)
            self._load(slot, adapter)
        self._lru.pop(slot, None)
        self._lru[slot] = None
        return slot

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer, linears in enumerate(self.linears):
            for fused, lin in linears.items():
                lin.set_slot(slot, [adapter.weights.get((layer, m))
                                    for m in self.parts[fused]])
        self.slots[slot] = adapter.key
        self.loads += 1

    def assign(self, adapters: Sequence[LoRAAdapter | None]) -> list[int]:
        """Each adapter's slot this step (-1 for the base), loading those not in one."""
        needed = {a.key for a in adapters if a is not None}
        if len(needed) > self.max_loras:
            raise InvalidRequestError(f"a step has {len(needed)} adapters, more than "
                                      f"max_loras={self.max_loras}", param="max_loras")
        return [-1 if a is None else self._assign(a, needed) for a in adapters]

    def prepare(self, row_adapters: Sequence[tuple[LoRAAdapter | None, int]],
                device: torch.device, dtype: torch.dtype) -> None:
        """Lay out the step: `row_adapters` = (adapter or None, rows) per chunk, in flat
        row order (single-token chunks first, as the runner flattens them)."""
        import torch

        step = self.step
        step.dense_rows, step.mask, step.row_slots, step.segments = 0, {}, None, []
        if all(a is None for a, _ in row_adapters):
            return
        dense: list[int] = []  # slot per single-token row, -1 for the base
        row = 0
        for (_, rows), slot in zip(row_adapters, self.assign([a for a, _ in row_adapters]),
                                   strict=True):
            if rows == 1 and row == len(dense):
                dense.append(slot)
            elif slot >= 0:
                step.segments.append((row, row + rows, slot))
            row += rows
        while dense and dense[-1] < 0:  # trailing base rows need no LoRA
            dense.pop()
        if not dense:
            return
        d, s, r = len(dense), self.max_loras, self.rank
        index = torch.tensor(dense, dtype=torch.long)
        step.dense_rows = d
        if step.kernel is not None:
            step.row_slots = index.to(device)
            return
        index[index < 0] = s  # base rows: a column that is dropped, so their mask is zero
        one_hot = torch.zeros(d, s + 1, dtype=dtype)
        one_hot[torch.arange(d), index] = 1
        one_hot = one_hot[:, :s]
        for p in (1, 2, 3):  # part-major, as the stacked A: [d, part, slot, rank]
            step.mask[p] = one_hot[:, None, :, None].expand(d, p, s, r).reshape(d, p * s * r) \
                .to(device)
