"""AsyncEngine with its core on a thread: streamed deltas, errors before the first yield,
abort on aclose/abort(), stop strings cut in the front end."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from sluice.engine.async_engine import AsyncEngine
from sluice.engine.config import EngineConfig
from sluice.engine.sampling_params import RequestOutputKind, SamplingParams
from sluice.protocol.errors import ContextLengthError

from .fakes import FakeTokenizer, PagedFakeRunner, reference_greedy

DELTA = RequestOutputKind.DELTA


@pytest.fixture
def engine() -> Iterator[AsyncEngine]:
    config = EngineConfig.from_options(None, block_size=4, max_num_batched_tokens=8)
    eng = AsyncEngine(config, PagedFakeRunner(num_kv_blocks=32, block_size=4, max_model_len=64,
                                                  step_delay=0.002))
    yield eng
    eng.shutdown()


async def wait_until(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_streams_deltas_that_join_to_the_full_output(engine: AsyncEngine) -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, output_kind=DELTA)
    outs = [o async for o in engine.generate(prompt, params, "a")]
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    assert len(outs) == 16 and outs[-1].finished and not outs[0].finished
    assert tokens == reference_greedy(prompt, 16)
    assert "".join(o.outputs[0].text for o in outs) == FakeTokenizer().decode(tokens)
    assert engine.stats().generation_tokens == 16


async def test_concurrent_requests_batch_together(engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def final(i: int) -> list[int]:
        last = None
        async for out in engine.generate([i + 1, 7, 7], params, f"c{i}"):
            last = out
        assert last is not None
        return last.outputs[0].token_ids

    results = await asyncio.gather(*(final(i) for i in range(5)))
    assert results == [reference_greedy([i + 1, 7, 7], 8) for i in range(5)]


async def test_admission_error_raises_before_first_output(engine: AsyncEngine) -> None:
    gen = engine.generate([1] * 60, SamplingParams(max_tokens=10), "big")
    with pytest.raises(ContextLengthError):
        await gen.__anext__()


async def test_aclose_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, output_kind=DELTA)
    gen = engine.generate(list(range(1, 12)), params, "x")
    first = await gen.__anext__()
    assert not first.finished
    assert engine.stats().kv_cache_usage > 0
    await gen.aclose()
    core = engine.client.core  # type: ignore[attr-defined]
    await wait_until(lambda: engine.stats().num_running == 0
                     and core.block_manager.num_free_blocks == 32)
    assert not core.has_work()


async def test_abort_ends_the_stream_with_abort(engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = []
    async for out in engine.generate(list(range(1, 12)), params, "y"):
        outs.append(out)
        if len(outs) == 2:
            await engine.abort("y")
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 40


async def test_stop_string_found_in_the_front_end_stops_the_core(engine: AsyncEngine) -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    full = FakeTokenizer().decode(reference_greedy(prompt, 16))
    stop = full[5:7]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    outs = [o async for o in engine.generate(prompt, params, "s")]
    final = outs[-1].outputs[0]
    assert final.text == full[:full.index(stop)]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    core = engine.client.core  # type: ignore[attr-defined]
    await wait_until(lambda: not core.has_work())  # the core heard and freed it
