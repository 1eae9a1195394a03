"""The model's generation_config.json sampling defaults over HTTP, as vLLM's
`--generation-config auto` applies them: a request that leaves a field out takes the
model's value, a chat's max_tokens its max_new_tokens (up to what the context leaves;
a completion's is OpenAI's 16 unless null), an explicit value wins; `--generation-config vllm` ignores the file; a bad value stops `sluice
worker` before the model loads. One tiny engine serves both settings: the defaults are
the worker's (WorkerConfig.generation_defaults, read from --model's directory)."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.cli import build_parser
from sluice.worker.app import build_app
from sluice.worker.cli import engine_config, worker_config

from .worker_helpers import ServerThread

FILE = {"temperature": 0, "top_p": 0.95, "repetition_penalty": 1.3, "max_new_tokens": 5,
        "do_sample": True, "eos_token_id": 2}
PROMPT = "The weather today is"
MAX_MODEL_LEN = 1024  # conftest's TINY_OPTIONS


def parse(*argv: str) -> Any:
    return build_parser(list(argv)).parse_args(list(argv))


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint (the engine's weights, linked) with FILE as its
    generation_config.json."""
    out = tmp_path_factory.mktemp("tiny-generation-config")
    for f in tiny_llama_dir.iterdir():
        if f.name != "generation_config.json":
            (out / f.name).symlink_to(f)
    (out / "generation_config.json").write_text(json.dumps(FILE))
    return out


def serve(engine: Any, *argv: str) -> ServerThread:
    """A worker app for `sluice worker ARGV`'s WorkerConfig, on the shared tiny engine."""
    args = parse("worker", *argv)
    config = worker_config(args, engine_config(args))
    app = build_app(engine, dataclasses.replace(config, served_model_names=("tiny",)))
    return ServerThread(app).start()


@pytest.fixture(scope="module")
def auto(engine: Any, model_dir: Path) -> Iterator[httpx.Client]:
    srv = serve(engine, "--model", str(model_dir))
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        yield client
    srv.stop()


@pytest.fixture(scope="module")
def plain(engine: Any, model_dir: Path) -> Iterator[httpx.Client]:
    srv = serve(engine, "--model", str(model_dir), "--generation-config", "vllm")
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        yield client
    srv.stop()


def complete(client: httpx.Client, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def chat(client: httpx.Client, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": PROMPT}], "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_flags_give_the_workers_defaults(model_dir: Path, tmp_path: Path) -> None:
    def defaults(*argv: str) -> dict[str, Any]:
        args = parse("worker", "--model", str(model_dir), *argv)
        return dict(worker_config(args, engine_config(args)).generation_defaults)

    assert defaults() == {"temperature": 0.0, "top_p": 0.95, "repetition_penalty": 1.3,
                          "max_tokens": 5}
    assert defaults("--generation-config", "auto") == defaults()
    assert defaults("--generation-config", "vllm") == {}
    (tmp_path / "generation_config.json").write_text('{"top_k": 20, "temperature": 0.7}')
    assert defaults("--generation-config", str(tmp_path)) == {"top_k": 20, "temperature": 0.7}


def test_a_request_without_max_tokens_takes_max_new_tokens_and_the_files_sampling(
        auto: httpx.Client, plain: httpx.Client) -> None:
    by_default = chat(auto)
    assert by_default["usage"]["completion_tokens"] == 5
    assert by_default["choices"][0]["finish_reason"] == "length"
    # the file's values, given explicitly where the file is ignored: the same greedy text
    explicit = chat(plain, temperature=0, top_p=0.95, repetition_penalty=1.3, max_tokens=5)
    assert by_default["choices"][0]["message"] == explicit["choices"][0]["message"]
    sampled = chat(plain, max_tokens=5, seed=1)  # without the file: temperature 1
    assert sampled["choices"][0]["message"] != explicit["choices"][0]["message"]
    # completions: max_tokens left out is OpenAI's 16, as in vLLM; null takes the model's
    assert complete(auto)["usage"]["completion_tokens"] == 16
    nulled = complete(auto, max_tokens=None)
    assert nulled["usage"]["completion_tokens"] == 5
    assert nulled["choices"][0]["text"] == complete(
        plain, temperature=0, top_p=0.95, repetition_penalty=1.3, max_tokens=5)["choices"][0]["text"]


def test_a_requests_own_values_win(auto: httpx.Client, plain: httpx.Client) -> None:
    assert chat(auto, max_tokens=3)["usage"]["completion_tokens"] == 3
    assert chat(auto, max_completion_tokens=2)["usage"]["completion_tokens"] == 2
    assert chat(auto, max_tokens=9)["usage"]["completion_tokens"] == 9  # past max_new_tokens
    sampled = complete(auto, temperature=1.5, seed=7, max_tokens=5)  # the file's top_p, penalty
    same = complete(plain, temperature=1.5, seed=7, top_p=0.95, repetition_penalty=1.3,
                    max_tokens=5)
    greedy = complete(auto, max_tokens=5)
    assert sampled["choices"][0]["text"] == same["choices"][0]["text"]
    assert sampled["choices"][0]["text"] != greedy["choices"][0]["text"]


def test_vllm_ignores_the_file(plain: httpx.Client) -> None:
    unset = complete(plain, seed=3, max_tokens=6)  # SamplingParams' temperature 1
    one = complete(plain, seed=3, max_tokens=6, temperature=1.0)
    greedy = complete(plain, temperature=0, max_tokens=6)
    assert unset["choices"][0]["text"] == one["choices"][0]["text"]
    assert unset["choices"][0]["text"] != greedy["choices"][0]["text"]


def test_the_default_max_tokens_stops_at_the_context(auto: httpx.Client) -> None:
    """vLLM takes the smaller of max_new_tokens and what the context leaves, per prompt;
    an explicit max_tokens past the context is still a 400."""
    long = [11] * (MAX_MODEL_LEN - 3)
    r = auto.post("/v1/completions", json={"prompt": [long, [11, 12]], "ignore_eos": True,
                                           "logprobs": 0, "max_tokens": None})
    assert r.status_code == 200, r.text
    tokens = sorted((c["index"], len(c["logprobs"]["tokens"])) for c in r.json()["choices"])
    assert tokens == [(0, 3), (1, 5)]
    text = "Hi " * (MAX_MODEL_LEN - 33)  # templated: 2 tokens short of the context
    r = auto.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}],
                                                "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] > MAX_MODEL_LEN - 5
    assert usage["completion_tokens"] == MAX_MODEL_LEN - usage["prompt_tokens"]
    r = auto.post("/v1/completions", json={"prompt": long, "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = auto.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                "min_tokens": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


def test_the_startup_warning_says_once_how_to_turn_them_off(
        engine: Any, model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="sluice.worker"):
        for argv in (("--model", str(model_dir)),
                     ("--model", str(model_dir), "--generation-config", "vllm")):
            args = parse("worker", *argv)
            build_app(engine, worker_config(args, engine_config(args)))
    warned = [r.getMessage() for r in caplog.records if "overridden" in r.getMessage()]
    assert len(warned) == 1
    assert "temperature=0.0" in warned[0] and "max_tokens=5" in warned[0]
    assert "--generation-config vllm" in warned[0]


def test_a_bad_value_stops_the_worker_before_the_model_loads(
        tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import sluice.worker.server

    def never(*_: Any) -> int:
        raise AssertionError("the worker started")

    monkeypatch.setattr(sluice.worker.server, "run_worker", never)
    (tmp_path / "generation_config.json").write_text('{"temperature": -0.5}')
    args = parse("worker", "--model", str(tiny_llama_dir), "--generation-config",
                 str(tmp_path))
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'generation_config.json'}: temperature must be" in err
    args = parse("worker", "--model", str(tiny_llama_dir), "--generation-config",
                 str(tmp_path / "missing"))
    assert args.func(args) == 2
    assert "no generation_config.json" in capsys.readouterr().err


def test_serve_passes_the_flag_on(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One engine in `sluice serve`'s process gets the defaults; workers behind a
    router get the flag."""
    import sluice.worker.server
    from sluice.serve import serve_one, worker_flags

    seen: list[Any] = []
    monkeypatch.setattr(sluice.worker.server, "run_worker",
                        lambda engine, worker, **_: seen.append(worker) or 0)
    args = parse("serve", "--model", str(model_dir), "--no-gateway")
    assert serve_one(args, None) == 0 and seen[0].generation_defaults["max_tokens"] == 5
    args = parse("serve", "--model", str(model_dir), "--generation-config", "vllm")
    assert "--generation-config" in worker_flags(args)
    assert worker_flags(args)[worker_flags(args).index("--generation-config") + 1] == "vllm"
