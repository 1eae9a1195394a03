"""Router configuration: frozen dataclasses layered router → pool → worker.

The CLI (`sluice router --worker URL ...`), a YAML/JSON file (`--config`) and the admin
endpoint all end up here, validated once in `__post_init__`. Runtime state (health,
load, learned costs) lives in `endpoints.py`, never in these objects.

    RouterConfig
     ├── pools: PoolConfig (model name + aliases, policy, long/short split)
     │     └── workers: WorkerSpec (url, optional KV-events endpoint, group)
     └── timings: scrape / health intervals, retry and ejection counts
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from sluice.protocol.edge import DEFAULT_MAX_BODY_BYTES
from sluice.protocol.errors import InvalidRequestError

SHORT = "short"
LONG = "long"
GROUPS = (SHORT, LONG)


@dataclass(frozen=True)
class WorkerSpec:
    """One worker: its base URL, its KV-events ZMQ endpoint (if it publishes), its group."""

    url: str
    kv_events: str | None = None
    group: str = SHORT

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise InvalidRequestError(f"worker url must start with http:// or https://: {self.url!r}",
                                      param="url")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if self.group not in GROUPS:
            raise InvalidRequestError(f"worker group must be one of {GROUPS}, got {self.group!r}",
                                      param="group")
        if self.kv_events is not None and "://" not in self.kv_events:
            raise InvalidRequestError(f"kv_events must be a ZMQ endpoint like tcp://host:port, "
                                      f"got {self.kv_events!r}", param="kv_events")


@dataclass(frozen=True)
class PoolConfig:
    """The workers serving one model.

    `model=None` means "whatever the workers serve": the pool answers to every model id
    its workers list in /v1/models (discovered by the health probe) plus `aliases`.
    `long_prompt_tokens`: prompts with more tokens go to the workers of group "long".
    `tokenizer`: a local tokenizer (HF dir or .gguf) to count and hash prompt tokens;
    None asks a worker's /tokenize (cached).
    """

    model: str | None = None
    aliases: tuple[str, ...] = ()
    workers: tuple[WorkerSpec, ...] = ()
    policy: str = "cost"
    long_prompt_tokens: int | None = None
    tokenizer: str | None = None
    block_size: int = 16
    policy_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise InvalidRequestError("block_size must be positive", param="block_size")
        if self.long_prompt_tokens is not None and self.long_prompt_tokens <= 0:
            raise InvalidRequestError("long_prompt_tokens must be positive",
                                      param="long_prompt_tokens")
        urls = [w.url for w in self.workers]
        if len(set(urls)) != len(urls):
            raise InvalidRequestError("a worker is listed twice in a pool", param="workers")

    @property
    def names(self) -> tuple[str, ...]:
        return ((self.model,) if self.model else ()) + self.aliases


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router process needs; `build_app(config)` reads nothing else."""

    pools: tuple[PoolConfig, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    admin_key: str | None = None  # None: /admin answers 403 (closed by default)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    scrape_interval_s: float = 0.5
    health_interval_s: float = 1.0
    eject_after_failures: int = 3
    readmit_after_successes: int = 1
    max_retries: int = 2
    migration_limit: int = 3  # mid-stream resumes per request on other workers; 0: off
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    max_connections: int = 1024
    tokenize_cache_size: int = 4096
    prefix_index_blocks: int = 200_000
    predicted_block_ttl_s: float = 10.0
    seed: int | None = None
    # requests held while a pool has no ready worker (scale from zero); 0 s: answer 503
    buffer_timeout_s: float = 0.0
    buffer_max_requests: int = 256

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise InvalidRequestError("max_retries must be >= 0", param="max_retries")
        if self.migration_limit < 0:
            raise InvalidRequestError("migration_limit must be >= 0", param="migration_limit")
        if self.eject_after_failures < 1 or self.readmit_after_successes < 1:
            raise InvalidRequestError("eject/readmit counts must be >= 1",
                                      param="eject_after_failures")
        if self.max_body_bytes < 1:
            raise InvalidRequestError("max_body_bytes must be positive", param="max_body_bytes")
        if self.scrape_interval_s <= 0 or self.health_interval_s <= 0:
            raise InvalidRequestError("intervals must be positive", param="scrape_interval_s")
        if self.buffer_timeout_s < 0 or self.buffer_max_requests < 0:
            raise InvalidRequestError("buffer_timeout_s and buffer_max_requests must be >= 0",
                                      param="buffer_timeout_s")

    def with_overrides(self, **changes: Any) -> RouterConfig:
        """A copy with the non-None `changes` applied (CLI flags over a config file)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def _worker_from(raw: str | Mapping[str, Any]) -> WorkerSpec:
    if isinstance(raw, str):
        return WorkerSpec(url=raw)
    return WorkerSpec(**_known(WorkerSpec, raw, "worker"))


def _known(cls: type, raw: Mapping[str, Any], what: str) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise InvalidRequestError(f"unknown {what} option(s): {', '.join(unknown)}",
                                  param=unknown[0])
    return dict(raw)


def pool_from_dict(raw: Mapping[str, Any]) -> PoolConfig:
    data = _known(PoolConfig, raw, "pool")
    data["workers"] = tuple(_worker_from(w) for w in data.get("workers", ()))
    data["aliases"] = tuple(data.get("aliases", ()))
    return PoolConfig(**data)


def router_from_dict(raw: Mapping[str, Any]) -> RouterConfig:
    data = _known(RouterConfig, raw, "router")
    data["pools"] = tuple(pool_from_dict(p) for p in data.get("pools", ()))
    return RouterConfig(**data)


def load_config_file(path: str | Path) -> RouterConfig:
    """Read a YAML (.yaml/.yml) or JSON router config file."""
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        raw = yaml.safe_load(text) or {}
    else:
        raw = json.loads(text)
    return router_from_dict(raw)


def parse_kv_event_flags(items: Sequence[str]) -> dict[str, str]:
    """`URL=tcp://host:port` pairs from `--worker-kv-events` into {url: endpoint}."""
    out: dict[str, str] = {}
    for item in items:
        url, sep, endpoint = item.partition("=")
        if not sep or not endpoint:
            raise InvalidRequestError(f"--worker-kv-events wants URL=tcp://host:port, got {item!r}",
                                      param="worker-kv-events")
        out[url.rstrip("/")] = endpoint
    return out
