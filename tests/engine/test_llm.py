"""The offline `LLM` used as a vLLM user uses `vllm.LLM`, on the tiny random model (SmolLM2's
real tokenizer and chat template): arguments of the wrong shape are InvalidRequestErrors
naming the argument, raised before anything is queued; token-id prompts in every shape
vLLM takes; `chat` reads messages, tools and `continue_final_message` by the worker's
rules; `shutdown()` / the context manager stop the engine's threads."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sluice.engine.llm import LLM
from sluice.engine.lora import LoRARequest
from sluice.engine.sampling_params import SamplingParams, StructuredOutputsParams
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.openai import ChatMessage
from sluice.worker.sampling import chat_prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
CHAT = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), num_kv_blocks=128, block_size=16, max_model_len=512,
               dtype="float32")


@pytest.mark.parametrize(("kwargs", "param"), [
    (dict(prompts=None), "prompts"),
    (dict(prompts=5), "prompts"),
    (dict(prompts=["a", 5]), "prompts"),
    (dict(prompts=[[1.5]]), "prompt"),  # was truncated to token 1
    (dict(prompts=[["7"]]), "prompt"),  # was token 7
    (dict(prompts=[[True, 2]]), "prompt"),
    (dict(prompts=["a"], sampling_params={"max_tokens": 3}), "sampling_params"),
    (dict(prompts=["a", "b"], sampling_params=[GREEDY, None]), "sampling_params"),
    (dict(prompts=["a", "b"], sampling_params=[GREEDY]), "sampling_params"),
    (dict(prompts=["a"], lora_request="sql"), "lora_request"),
    (dict(prompts=["a"], lora_request=[None, None]), "lora_request"),
    (dict(prompts=["a", "b"], priority=[1]), "priority"),
    (dict(prompts=["a"], priority=1), "priority"),
])
def test_an_argument_of_the_wrong_shape_names_it(llm: LLM, kwargs: dict[str, Any],
                                                 param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(**kwargs)
    assert err.value.param == param
    assert not llm.engine.has_unfinished_requests()


def test_token_id_prompts_in_every_shape_read_alike(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("The capital of France is")
    shapes: list[Any] = [ids, tuple(ids), np.array(ids), [np.int64(t) for t in ids],
                         {"prompt_token_ids": ids}]
    want = llm.generate("The capital of France is", GREEDY)[0].outputs[0].token_ids
    for shape in shapes:
        out = llm.generate(shape, GREEDY)
        assert len(out) == 1 and out[0].prompt_token_ids == ids, type(shape)
        assert out[0].outputs[0].token_ids == want and out[0].prompt is None


def test_a_list_of_params_and_priorities_goes_prompt_by_prompt(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=5, logprobs=2)
    alone = llm.generate("Hi", seeded)[0].outputs[0]
    outs = llm.generate(["Yo", "Hi"], [GREEDY, seeded], priority=[1, 0])
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 5]
    got = outs[1].outputs[0]
    assert got.token_ids == alone.token_ids  # a seed draws the same whatever the batch
    assert got.logprobs is not None and len(got.logprobs) == 5
    assert got.cumulative_logprob == pytest.approx(
        sum(lp[t] for lp, t in zip(got.logprobs, got.token_ids, strict=True)))


def _text(llm: LLM, out: Any) -> str:
    return str(llm.get_tokenizer().decode(out.prompt_token_ids, skip_special_tokens=False))


def test_chat_reads_messages_and_tools_as_the_worker_does(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    parts = [{"role": "user", "content": [{"type": "text", "text": "H"},
                                          {"type": "text", "text": "i"}]}]
    out = llm.chat(parts, GREEDY, tools=TOOLS)[0]
    worker = chat_prompt(tok, [ChatMessage(role="user", content="Hi")], tools=TOOLS)
    assert out.prompt_token_ids == tok.encode(worker, add_special_tokens=False)
    assert "get_weather" in _text(llm, out)
    assert out.prompt == worker  # the templated text, as vLLM's chat outputs carry
    conversations: list[Any] = [CHAT, parts]
    batch = llm.chat(conversations, GREEDY, use_tqdm=False)
    assert batch[0].prompt_token_ids == batch[1].prompt_token_ids


def test_chat_continues_a_final_message_and_takes_a_template(llm: LLM) -> None:
    prefill = [*CHAT, {"role": "assistant", "content": "Hello! I am"}]
    out = llm.chat(prefill, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert _text(llm, out[0]).endswith("<|im_start|>assistant\nHello! I am")
    bare = llm.chat(CHAT, GREEDY, add_generation_prompt=False)[0]
    assert _text(llm, bare).endswith("Hi<|im_end|>\n")
    own = llm.chat(CHAT, GREEDY, chat_template="{% for m in messages %}<{{ m.role }}> "
                   "{{ m.content }}{% endfor %}")[0]
    assert _text(llm, own) == "<user> Hi"
    switch = "{% for m in messages %}{{ m.content }}{% endfor %}{% if not enable_thinking %}!{% endif %}"
    off = llm.chat(CHAT, GREEDY, chat_template=switch,
                   chat_template_kwargs={"enable_thinking": False})[0]
    on = llm.chat(CHAT, GREEDY, chat_template=switch,
                  chat_template_kwargs={"enable_thinking": True})[0]
    assert (_text(llm, off), _text(llm, on)) == ("Hi!", "Hi")


@pytest.mark.parametrize(("messages", "kwargs", "param"), [
    (CHAT + [{"role": "assistant", "content": "Hello"}], dict(continue_final_message=True),
     "continue_final_message"),
    ([{"content": "Hi"}], {}, "messages.0"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
     "messages.0.content"),
    ("Hi", {}, "messages"),
    (CHAT, dict(chat_template="{{ messages[5].content }}"), "messages"),
    (CHAT, dict(tools={"type": "function"}), "tools"),
    (CHAT, dict(chat_template_kwargs={"tools": []}), "chat_template_kwargs"),
    (CHAT, dict(chat_template_kwargs={"eos_token": "x"}), "chat_template_kwargs"),
])
def test_a_chat_the_worker_would_refuse_names_the_field(
        llm: LLM, messages: Any, kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        llm.chat(messages, GREEDY, **kwargs)
    assert err.value.param == param


def test_a_vllm_style_lora_request_is_refused_naming_the_path() -> None:
    """vLLM's LoRARequest(name, int_id, path) put the id where sluice reads the path."""
    with pytest.raises(InvalidRequestError, match="lora_int_id") as err:
        LoRARequest("sql", 1, "/adapters/sql")  # type: ignore[arg-type]
    assert err.value.param == "lora_path"
    assert LoRARequest("sql", Path("/adapters/sql")).lora_path == "/adapters/sql"  # type: ignore[arg-type]


def test_shutdown_stops_the_engine_threads(tiny_llama_dir: Path) -> None:
    json_object = SamplingParams(temperature=0.0, max_tokens=8,
                                 structured_outputs=StructuredOutputsParams(json_object=True))
    with LLM(str(tiny_llama_dir), num_kv_blocks=32, block_size=16, max_model_len=256,
             dtype="float32", structured_outputs_backend="guidance") as llm:
        before = set(threading.enumerate())
        llm.generate("{", json_object)
        started = [t for t in set(threading.enumerate()) - before
                   if t.name.startswith("sluice-grammar")]
        assert len(started) == 1  # this engine's compile thread
    started[0].join(timeout=5)
    assert not started[0].is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("a", GREEDY)
    llm.shutdown()  # again: nothing to do


def test_an_interrupted_generate_leaves_nothing_running(llm: LLM,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or a request's compile failure raised by a step) out of `generate` aborts
    the call's other prompts: the next call does not step them to the end unseen."""
    step, calls = llm.engine.step, []

    def interrupted() -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a", "b"], SamplingParams(max_tokens=50, ignore_eos=True))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.usage == 0.0


def test_logprobs_read_as_vllms_logprob_objects_and_as_floats(llm: LLM) -> None:
    """vLLM code reads `lp[t].logprob`, `.rank`, `.decoded_token`; sluice's reads floats."""
    tok = llm.get_tokenizer()
    greedy = llm.generate("The capital of France is",
                          SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))[0].outputs[0]
    sampled = llm.generate("The capital of France is", SamplingParams(
        temperature=1.0, seed=1, max_tokens=16, logprobs=1))[0].outputs[0]
    assert greedy.logprobs is not None and sampled.logprobs is not None
    entries: list[dict[int, Any]] = list(greedy.logprobs)
    for t, entry in zip(greedy.token_ids, entries, strict=True):
        lp = entry[t]
        assert lp.rank == 1 and lp.logprob == float(lp) <= 0.0
        assert sorted(e.rank for e in entry.values()) == [1, 2, 3]
        assert all(e.decoded_token == tok.decode([k], skip_special_tokens=False)
                   for k, e in entry.items())
    assert greedy.cumulative_logprob == pytest.approx(
        sum(e[t] for e, t in zip(greedy.logprobs, greedy.token_ids, strict=True)))
    # a sampled token outside the top 1 is listed first, rank unknown; the top one is rank 1
    outside = [e for t, e in zip(sampled.token_ids, sampled.logprobs, strict=True) if len(e) == 2]
    assert outside, "seed 1 should sample some token that is not the most likely"
    for entry in outside:
        first, best = entry.values()
        assert first.rank is None and best.rank == 1 and best >= first  # type: ignore[attr-defined]
    lp = greedy.logprobs[0][greedy.token_ids[0]]
    assert pickle.loads(pickle.dumps(lp)).rank == 1 and repr(lp).startswith("Logprob(logprob=")


def test_use_tqdm_takes_a_tqdm_like_factory_as_vllm_does(llm: LLM) -> None:
    """It was called with the standard tqdm whatever the caller passed."""
    bars: list[dict[str, Any]] = []

    class Bar:
        def __init__(self, **kwargs: Any) -> None:
            self.updates = 0
            bars.append({"kwargs": kwargs, "bar": self})

        def update(self, n: int) -> None:
            self.updates += n

        def close(self) -> None:
            bars[-1]["closed"] = True

    llm.generate(["a", "b", "c"], GREEDY, use_tqdm=Bar)
    assert len(bars) == 1 and bars[0]["kwargs"]["total"] == 3
    assert bars[0]["bar"].updates == 3 and bars[0]["closed"]
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(["a"], GREEDY, use_tqdm="yes")  # type: ignore[arg-type]
    assert err.value.param == "use_tqdm" and not llm.engine.has_unfinished_requests()


def test_logit_bias_steers_the_offline_api_and_a_token_past_the_vocab_names_it(
        llm: LLM) -> None:
    """`SamplingParams(logit_bias=...)` as vLLM's: +100 on a token makes greedy decoding
    repeat it; an id past the vocabulary is refused naming logit_bias (it would index
    past the logits)."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    plain = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    forced = next(t for t in range(100, 110) if t not in plain)
    biased = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                            logit_bias={forced: 100.0})
    out = llm.generate([[5, 6, 7]], biased, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == [forced] * 3
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([[5, 6, 7]], SamplingParams(logit_bias={10**7: 1.0}), use_tqdm=False)
    assert err.value.param == "logit_bias"
