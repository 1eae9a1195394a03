"""LoRA adapters over HTTP (vLLM's shapes): `--lora-modules`, `/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`, `/v1/models` with `parent`, `model` selecting an adapter, the
`vllm:lora_requests_info` gauge; broken adapters are a 400 and the worker keeps serving;
unloading an adapter in use lets its running requests finish."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lora_adapters import make_adapter
from sluice.engine.config import EngineConfig
from sluice.worker.app import build_app
from sluice.worker.config import WorkerConfig

from .conftest import TINY_OPTIONS
from .worker_helpers import ServerThread, wait_until


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path
                 ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("http-adapters")
    return {"a": make_adapter(tiny_llama_dir, root / "a", r=8, seed=11),
            "b": make_adapter(tiny_llama_dir, root / "b", r=4, seed=12,
                              targets=("q_proj", "v_proj")),
            "r32": make_adapter(tiny_llama_dir, root / "r32", r=32, seed=13)}


@pytest.fixture(scope="module")
def lora_server(tiny_llama_dir: Path, adapter_dirs: dict[str, Path]) -> Iterator[ServerThread]:
    from sluice.engine.async_engine import AsyncEngine

    engine = AsyncEngine(EngineConfig.from_options(
        str(tiny_llama_dir), **TINY_OPTIONS, enable_lora=True, max_loras=2, max_lora_rank=16))
    app = build_app(engine, WorkerConfig(served_model_names=("tiny",),
                                         lora_modules=(("sql", str(adapter_dirs["a"])),)))
    srv = ServerThread(app).start()
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.fixture()
def client(lora_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=lora_server.url, timeout=60) as c:
        yield c


def _complete(client: httpx.Client, model: str, max_tokens: int = 8) -> httpx.Response:
    return client.post("/v1/completions", json={
        "model": model, "prompt": "The capital of France is", "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True})


def _error(resp: httpx.Response) -> dict[str, Any]:
    return resp.json()["error"]


def test_models_list_adapters_with_parent(client: httpx.Client, adapter_dirs: dict) -> None:
    data = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert data["tiny"]["parent"] is None
    assert data["sql"]["parent"] == "tiny" and data["sql"]["root"] == str(adapter_dirs["a"])


def test_model_selects_the_adapter(client: httpx.Client) -> None:
    base, sql = _complete(client, "tiny"), _complete(client, "sql")
    assert base.status_code == sql.status_code == 200
    assert sql.json()["model"] == "sql"
    assert base.json()["choices"][0]["text"] != sql.json()["choices"][0]["text"]
    assert _complete(client, "sql").json()["choices"][0]["text"] == \
        sql.json()["choices"][0]["text"]
    chat = client.post("/v1/chat/completions", json={
        "model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["model"] == "sql"


def test_load_use_unload(client: httpx.Client, adapter_dirs: dict) -> None:
    body = {"lora_name": "chat-b", "lora_path": str(adapter_dirs["b"])}
    resp = client.post("/v1/load_lora_adapter", json=body)
    assert resp.status_code == 200
    assert resp.text == "Success: LoRA adapter 'chat-b' added successfully."
    assert "chat-b" in {m["id"] for m in client.get("/v1/models").json()["data"]}
    assert _complete(client, "chat-b").status_code == 200
    again = client.post("/v1/load_lora_adapter", json=body)
    assert again.status_code == 400
    assert _error(again)["message"] == "The lora adapter 'chat-b' has already been loaded."
    resp = client.post("/v1/unload_lora_adapter", json={"lora_name": "chat-b"})
    assert resp.status_code == 200
    assert resp.text == "Success: LoRA adapter 'chat-b' removed successfully."
    assert _complete(client, "chat-b").status_code == 404
    gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "chat-b"})
    assert gone.status_code == 404
    assert _error(gone)["message"] == "The lora adapter 'chat-b' cannot be found."


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/load_lora_adapter", {"lora_path_typo": "x"}, "lora_path_typo"),
    ("/v1/load_lora_adapter", {"load_inplace": True}, "load_inplace"),
    ("/v1/unload_lora_adapter", {"lora_int_id": 3}, "lora_int_id"),
])
def test_unknown_or_unsupported_fields_are_refused(client: httpx.Client, adapter_dirs: dict,
                                                   path: str, extra: dict, param: str) -> None:
    """Found by a new-user pass: an unknown field (or vLLM's load_inplace: true, a reload
    of a loaded name) was silently ignored and the adapter loaded as if it were absent."""
    body = {"lora_name": "extra-field", **extra}
    if path == "/v1/load_lora_adapter":
        body["lora_path"] = str(adapter_dirs["b"])
    resp = client.post(path, json=body)
    assert resp.status_code == 400 and _error(resp)["param"] == param, resp.text
    assert "extra-field" not in {m["id"] for m in client.get("/v1/models").json()["data"]}


def test_vllms_optional_fields_at_their_defaults_are_accepted(client: httpx.Client,
                                                              adapter_dirs: dict) -> None:
    body = {"lora_name": "defaults", "lora_path": str(adapter_dirs["b"]), "load_inplace": False}
    assert client.post("/v1/load_lora_adapter", json=body).status_code == 200
    assert client.post("/v1/unload_lora_adapter", json={
        "lora_name": "defaults", "lora_int_id": None}).status_code == 200


def test_broken_adapters_are_400_and_the_worker_keeps_serving(
        client: httpx.Client, adapter_dirs: dict, tmp_path: Path) -> None:
    no_weights = shutil.copytree(adapter_dirs["b"], tmp_path / "no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    wrong_base = shutil.copytree(adapter_dirs["b"], tmp_path / "wrong-base")
    cfg = json.loads((wrong_base / "adapter_config.json").read_text())
    cfg["r"] = 2  # the weights are rank 4: shapes no longer fit
    (wrong_base / "adapter_config.json").write_text(json.dumps(cfg))
    cases = {str(adapter_dirs["r32"]): "LoRA rank 32 is greater than max_lora_rank 16",
             str(tmp_path / "nowhere"): "does not exist",
             str(no_weights): "has no adapter_model.safetensors",
             str(wrong_base): "another base model"}
    for path, message in cases.items():
        resp = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
        assert resp.status_code == 400, path
        assert message in _error(resp)["message"] and _error(resp)["param"] == "lora_path"
    missing = client.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert missing.status_code == 400
    assert _error(missing)["message"] == "Both 'lora_name' and 'lora_path' must be provided."
    assert "x" not in {m["id"] for m in client.get("/v1/models").json()["data"]}
    assert _complete(client, "tiny").status_code == 200
    assert _complete(client, "sql").status_code == 200


def test_unload_while_in_use_lets_running_requests_finish(client: httpx.Client,
                                                          adapter_dirs: dict) -> None:
    assert client.post("/v1/load_lora_adapter", json={
        "lora_name": "busy", "lora_path": str(adapter_dirs["b"])}).status_code == 200
    results: list[httpx.Response] = []

    def one() -> None:
        with httpx.Client(base_url=str(client.base_url), timeout=60) as c:
            results.append(_complete(c, "busy", max_tokens=200))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    def all_running() -> bool:  # every request admitted, so none arrives after the unload
        text = client.get("/metrics").text
        running = next(float(x.split()[-1]) for x in text.splitlines()
                       if x.startswith("vllm:num_requests_running{"))
        return running >= 4 and 'running_lora_adapters="busy' in text

    assert wait_until(all_running, timeout=20)
    assert client.post("/v1/unload_lora_adapter",
                       json={"lora_name": "busy"}).status_code == 200
    for t in threads:
        t.join(timeout=60)
    assert [r.status_code for r in results] == [200] * 4
    assert all(r.json()["usage"]["completion_tokens"] == 200 for r in results)
    assert _complete(client, "busy").status_code == 404


def test_lora_requests_info_gauge(client: httpx.Client) -> None:
    text = client.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'waiting_lora_adapters=""' in line


def test_cli_lora_flags() -> None:
    from sluice.cli import build_parser
    from sluice.worker.cli import engine_config, worker_config

    argv = ["worker", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32",
            "--max-cpu-loras", "6", "--lora-modules", "a=/x/a", "b=/x/b"]
    args = build_parser(argv).parse_args(argv)
    lora = engine_config(args).lora
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == \
        (True, 3, 32, 6)
    assert worker_config(args).lora_modules == (("a", "/x/a"), ("b", "/x/b"))
