"""Serving behaviour: health while loading and while busy, client disconnects abort,
metrics under vLLM's names, models, tokenize/detokenize."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

import sluice
from sluice.engine.config import EngineConfig
from sluice.worker.app import build_app
from sluice.worker.config import WorkerConfig

from .conftest import TINY_OPTIONS
from .worker_helpers import ServerThread, free_port, wait_until

USER = [{"role": "user", "content": "hi"}]


def metrics(http: httpx.Client) -> dict[str, float]:
    """name{labels} -> value for every sample in /metrics."""
    resp = http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def stream_lines(url: str, body: dict, stop_after: int, started: threading.Event) -> int:
    """Read `stop_after` SSE data lines, then drop the connection; returns lines read."""
    seen = 0
    with httpx.stream("POST", url, json=body, timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data:"):
                seen += 1
                started.set()
                if seen >= stop_after:
                    break
    return seen


async def test_health_is_503_until_the_engine_is_attached(engine: Any) -> None:
    app = build_app(None, WorkerConfig())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        assert (await client.get("/health")).status_code == 503
        resp = await client.post("/v1/chat/completions", json={"messages": USER})
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["type"] == "service_unavailable"
        app.state.worker.attach(engine)
        assert (await client.get("/health")).status_code == 200
        resp = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
        assert resp.status_code == 200


def test_models_and_alias(http: httpx.Client) -> None:
    data = http.get("/v1/models").json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == ["tiny", "tiny-alias"]
    assert data["data"][0]["max_model_len"] == 1024
    resp = http.post("/v1/chat/completions",
                     json={"model": "tiny-alias", "messages": USER, "max_tokens": 2})
    assert resp.status_code == 200 and resp.json()["model"] == "tiny-alias"


def test_tokenize_detokenize(http: httpx.Client) -> None:
    text = "The quick brown fox"
    tok = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) > 0
    assert tok["max_model_len"] == 1024
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": text}
    chat = http.post("/tokenize", json={"messages": USER}).json()
    prompt = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n") and "hi" in prompt
    usage = http.post("/v1/chat/completions",
                      json={"messages": USER, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == chat["count"]
    assert http.post("/tokenize", json={"prompt": "a", "messages": USER}).status_code == 400
    # vLLM's /tokenize takes the chat request's `tools` (the template renders them): the
    # count is then the chat's usage.prompt_tokens (the worker refused the field)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_tools = http.post("/tokenize", json={"messages": USER, "tools": tools}).json()
    usage = http.post("/v1/chat/completions", json={"messages": USER, "tools": tools,
                                                    "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == with_tools["count"] > chat["count"]
    assert http.post("/tokenize", json={"prompt": "a", "tools": tools}).status_code == 400
    assert http.post("/detokenize", json={"tokens": [-1]}).status_code == 400


def test_a_final_message_is_continued(http: httpx.Client) -> None:
    """Anthropic's prefill (a last assistant message with text) and vLLM's
    continue_final_message: the template closed that message and opened a new assistant
    turn, so the model answered the prefill instead of going on from it (and vLLM's
    field was a 400)."""
    convo = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": "The answer is"}]
    go_on = {"messages": convo, "continue_final_message": True, "add_generation_prompt": False}
    tok = http.post("/tokenize", json=go_on).json()
    text = http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nThe answer is"), text
    chat = http.post("/v1/chat/completions", json={**go_on, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == tok["count"]
    msg = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 1,
                                          "messages": convo}).json()
    assert msg["usage"]["input_tokens"] == tok["count"]
    resp = http.post("/v1/chat/completions", json={"messages": convo, "max_tokens": 1,
                                                   "continue_final_message": True})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "continue_final_message"


def test_metrics_use_vllm_names(http: httpx.Client) -> None:
    for _ in range(2):
        http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4,
                                                "ignore_eos": True})
    m = metrics(http)
    label = "{model_name=tiny}"
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:kv_cache_usage_perc"):
        assert gauge + label in m
    for counter in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                    "vllm:num_preemptions_total"):
        assert counter + label in m
    assert m["vllm:prompt_tokens_total" + label] > 0
    assert m["vllm:generation_tokens_total" + label] >= 8
    # the second identical prompt hits the prefix cache
    assert m["vllm:prefix_cache_hits_total" + label] > 0
    assert m["vllm:request_success_total{finished_reason=length,model_name=tiny}"] >= 2
    for hist in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens", "vllm:request_params_n",
                 "vllm:request_params_max_tokens"):
        assert m[hist + "_count" + label] >= 2
    # vLLM's dashboard reads these per request: 4 generated tokens each, max_tokens 4
    assert m["vllm:request_generation_tokens_bucket{le=5.0,model_name=tiny}"] >= 2
    assert m["vllm:request_params_max_tokens_bucket{le=5.0,model_name=tiny}"] >= 2
    assert m["vllm:request_params_n_bucket{le=1.0,model_name=tiny}"] >= 2
    # vLLM's engine-step histogram: its buckets; its sum grows with the token counters
    steps = {k for k in m if k.startswith("vllm:iteration_tokens_total_bucket")}
    assert steps == {f"vllm:iteration_tokens_total_bucket{{le={b},model_name=tiny}}"
                     for b in ("1.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0", "512.0",
                               "1024.0", "2048.0", "4096.0", "8192.0", "16384.0", "+Inf")}
    assert m["vllm:iteration_tokens_total_count" + label] >= 8  # 4 steps with output each
    assert m["vllm:iteration_tokens_total_sum" + label] == (
        m["vllm:prompt_tokens_total" + label] + m["vllm:generation_tokens_total" + label])


def test_refused_generation_requests_are_counted_by_reason(http: httpx.Client) -> None:
    """sluice:requests_rejected_total was declared and never counted (found by the
    observability pass); a generation request refused before its answer counts under its
    error's code, else its type. Other routes' errors (a 404 path) do not."""
    def count(reason: str) -> float:
        return metrics(http).get(
            f"sluice:requests_rejected_total{{model_name=tiny,reason={reason}}}", 0.0)

    too_long, bad = count("context_length_exceeded"), count("invalid_request_error")
    r = http.post("/v1/completions", json={"prompt": "a " * 5000, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": -1})
    assert r.status_code == 400
    assert http.post("/v1/nowhere", json={}).status_code == 404
    assert count("context_length_exceeded") == too_long + 1
    assert count("invalid_request_error") == bad + 1


def test_version_answers_as_vllms(http: httpx.Client) -> None:
    r = http.get("/version")
    assert r.status_code == 200 and r.json() == {"version": sluice.__version__}


def test_health_answers_while_a_long_request_runs(server: ServerThread, engine: Any,
                                                  http: httpx.Client) -> None:
    """The engine runs on its own thread: /health stays fast during a long prefill+decode."""
    prompt = list(range(1000, 1900))  # a 900-token prompt
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["resp"] = httpx.post(server.url + "/v1/completions", timeout=60,
                                    json={"prompt": prompt, "max_tokens": 120,
                                          "ignore_eos": True})

    thread = threading.Thread(target=long_request)
    thread.start()
    assert wait_until(lambda: engine.stats().num_running + engine.stats().num_waiting > 0, 10,
                      0.001)
    latencies = []
    while thread.is_alive() and len(latencies) < 50:
        busy = engine.stats().num_running > 0
        start = time.perf_counter()
        assert http.get("/health").status_code == 200
        if busy:
            latencies.append(time.perf_counter() - start)
    thread.join(60)
    assert result["resp"].status_code == 200
    assert len(latencies) >= 3, "the long request finished before health could be measured"
    assert max(latencies) < 0.5, latencies


def test_client_disconnect_aborts_the_stream(server: ServerThread, engine: Any,
                                             http: httpx.Client) -> None:
    before = metrics(http)["vllm:generation_tokens_total{model_name=tiny}"]
    started = threading.Event()
    body = {"messages": USER, "max_tokens": 800, "ignore_eos": True, "stream": True}
    seen = stream_lines(server.url + "/v1/chat/completions", body, 3, started)
    assert seen == 3
    assert wait_until(lambda: engine.stats().num_running == 0, 10)
    m = metrics(http)
    assert m["vllm:num_requests_running{model_name=tiny}"] == 0
    assert m["vllm:kv_cache_usage_perc{model_name=tiny}"] == 0
    assert m["sluice:http_requests_pending{model_name=tiny}"] == 0
    generated = m["vllm:generation_tokens_total{model_name=tiny}"] - before
    assert generated < 800  # stopped early: the request was aborted, not run to the end


def test_an_aborted_request_s_span_says_so(server: ServerThread, engine: Any,
                                           http: httpx.Client) -> None:
    """A stream the client left: the worker's span carries its usage so far and vLLM's
    finish reason `abort` (it read 0 / 0 tokens and no reason: a success to whoever read
    the trace; found by the observability pass)."""
    from sluice.observe.span_export import MemorySink
    from sluice.observe.tracing import Tracing

    state = server.server.config.app.state.worker
    sink = MemorySink()
    state.tracing = Tracing(sink)
    try:
        started = threading.Event()
        body = {"messages": USER, "max_tokens": 800, "ignore_eos": True, "stream": True}
        assert stream_lines(server.url + "/v1/chat/completions", body, 4, started) == 4
        assert wait_until(lambda: engine.stats().num_running == 0 and sink.records, 10)
    finally:
        state.tracing = None
    (span,) = [r for r in sink.records if r.kind == "SERVER"]
    a = span.attributes
    assert a["gen_ai.response.finish_reasons"] == ["abort"]
    assert a["sluice.request.aborted"] is True
    assert a["gen_ai.usage.input_tokens"] > 0 and 3 <= a["gen_ai.usage.output_tokens"] < 800


def test_client_timeout_aborts_a_non_streaming_request(server: ServerThread, engine: Any,
                                                       http: httpx.Client) -> None:
    before = metrics(http)["vllm:generation_tokens_total{model_name=tiny}"]
    try:
        httpx.post(server.url + "/v1/completions", timeout=0.5,
                   json={"prompt": "a", "max_tokens": 1000, "ignore_eos": True})
        raise AssertionError("expected the client to time out")
    except httpx.TimeoutException:
        pass
    assert wait_until(lambda: engine.stats().num_running == 0, 10)
    m = metrics(http)
    assert m["sluice:http_requests_pending{model_name=tiny}"] == 0
    assert m["vllm:generation_tokens_total{model_name=tiny}"] - before < 1000


def test_kv_events_are_published_in_vllm_format(tiny_llama_dir: Path) -> None:
    import zmq

    from sluice.engine.async_engine import AsyncEngine
    from sluice.protocol.kv_events import BlockStored, decode_batch

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = AsyncEngine(EngineConfig.from_options(str(tiny_llama_dir), **TINY_OPTIONS),
                         kv_events_endpoint=endpoint)  # the core publishes, as vLLM's does
    srv = ServerThread(build_app(engine, WorkerConfig())).start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        time.sleep(0.3)  # let the subscription reach the publisher (ZMQ slow joiner)
        prompt = list(range(2000, 2100))  # 100 new tokens: 6 full blocks of 16
        resp = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert resp.status_code == 200
        tokens: list[int] = []  # the stored blocks' tokens, from the block holding prompt[:16]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(tokens) < 96:
            if sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                assert len(seq) == 8
                for event in decode_batch(payload).events:
                    if isinstance(event, BlockStored) and (
                            tokens or event.token_ids[:16] == prompt[:16]):
                        tokens += event.token_ids
        assert tokens[:96] == prompt[:96]  # 6 full blocks of 16, hashed and announced
    finally:
        sub.close(0)
        ctx.term()
        srv.stop()
        engine.shutdown()
