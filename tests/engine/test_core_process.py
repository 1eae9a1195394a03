"""AsyncEngine with its core in a child process (the worker's default): the same tokens
as the in-thread core, abort frees the request in the child, a dead child fails every
open stream with a 503 and is seen at once, and shutdown is prompt under load."""

from __future__ import annotations

import asyncio
import multiprocessing.context
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice.engine.async_engine import AsyncEngine
from sluice.engine.config import EngineConfig
from sluice.engine.core_client import CoreDied, ProcessCore, single_threaded
from sluice.engine.messages import Abort, CoreOutputs, decode, encode
from sluice.engine.sampling_params import RequestOutputKind, SamplingParams
from sluice.engine.tokenizer import ModelNotFoundError

OPTIONS: dict[str, Any] = dict(num_kv_blocks=256, block_size=16, max_model_len=512,
                               max_num_seqs=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def config(tiny_llama_dir: Path) -> EngineConfig:
    return EngineConfig.from_options(str(tiny_llama_dir), **OPTIONS)


@pytest.fixture()
def engine(config: EngineConfig) -> Iterator[AsyncEngine]:
    eng = AsyncEngine.spawn(config)
    yield eng
    eng.shutdown()


async def final(engine: AsyncEngine, prompt: list[int], rid: str,
                params: SamplingParams = GREEDY) -> list[int]:
    last = None
    async for out in engine.generate(prompt, params, rid):
        last = out
    assert last is not None and last.finished
    return last.outputs[0].token_ids


async def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_same_tokens_as_the_thread_core(engine: AsyncEngine, config: EngineConfig) -> None:
    prompts = [[5, 9, 13, 2, 7] * (i + 1) for i in range(4)]
    in_process = AsyncEngine(config)
    try:
        expected = await asyncio.gather(*(final(in_process, p, f"t{i}")
                                          for i, p in enumerate(prompts)))
    finally:
        in_process.shutdown()
    got = await asyncio.gather(*(final(engine, p, f"p{i}") for i, p in enumerate(prompts)))
    assert got == expected
    assert engine.stats().generation_tokens == 12 * len(prompts)
    assert engine.client.info.max_model_len == 512


async def test_step_log_records_what_each_step_ran(tiny_llama_dir: Path,
                                                   tmp_path: Path) -> None:
    """`--step-log DIR`: the child core writes its shape, then one line per step with the
    chunks it ran (a 5-token prompt, then 11 single-token decodes) and their seconds."""
    from sluice.engine.step_log import read_step_logs

    eng = AsyncEngine.spawn(EngineConfig.from_options(str(tiny_llama_dir), **OPTIONS,
                                                      step_log=str(tmp_path / "steps")))
    try:
        await final(eng, [5, 9, 13, 2, 7], "s0")
    finally:
        eng.shutdown()
    header, points = read_step_logs([str(tmp_path / "steps")])
    assert (header["block_size"], header["num_kv_blocks"], header["max_num_seqs"]) == (16, 256, 8)
    assert [chunks for chunks, _ in points] == [[(0, 5)]] + [[(p, 1)] for p in range(5, 16)]
    assert all(0 < seconds < 60 for _, seconds in points)


async def test_aclose_aborts_in_the_child(engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    gen = engine.generate(list(range(1, 40)), params, "long")
    await gen.__anext__()
    assert engine.stats().num_running == 1
    await gen.aclose()
    await wait_for(lambda: engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0)
    assert engine.stats().generation_tokens < 400


async def test_killed_core_fails_open_streams_with_503(engine: AsyncEngine) -> None:
    client = engine.client
    assert isinstance(client, ProcessCore) and client.pid is not None
    deaths: list[CoreDied] = []
    engine.on_death.append(deaths.append)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    gen = engine.generate(list(range(1, 40)), params, "doomed")
    await gen.__anext__()
    os.kill(client.pid, signal.SIGKILL)
    with pytest.raises(CoreDied) as err:
        async for _ in gen:
            pass
    assert err.value.status_code == 503 and "exit code -9" in err.value.message
    await wait_for(lambda: bool(deaths))
    with pytest.raises(CoreDied):
        await anext(engine.generate([1, 2, 3], GREEDY, "after"))


async def test_shutdown_is_prompt_while_requests_run(engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
    gens = [engine.generate([i + 1] * 20, params, f"busy{i}") for i in range(6)]
    for gen in gens:
        await gen.__anext__()
    client = engine.client
    assert isinstance(client, ProcessCore)
    start = time.monotonic()
    await asyncio.to_thread(engine.shutdown)
    assert time.monotonic() - start < 5
    assert not client.process.is_alive() and client.process.exitcode == 0
    for gen in gens:
        with pytest.raises(Exception, match="shut down"):
            async for _ in gen:
                pass


def test_bad_model_fails_with_its_own_error_and_the_child_is_gone(tmp_path: Path) -> None:
    core = ProcessCore(EngineConfig.from_options(str(tmp_path / "nope")))
    with pytest.raises(ModelNotFoundError):
        core.wait_ready()
    assert not core.process.is_alive()


def test_a_fork_is_never_made_from_a_process_with_threads(config: EngineConfig) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert not single_threaded()
        core = ProcessCore(config, start_method="fork")
    finally:
        stop.set()
        thread.join()
    try:
        assert isinstance(core.process, multiprocessing.context.SpawnProcess)
    finally:
        core.process.kill()
        core.close()


def test_single_threaded_is_true_only_without_threads() -> None:
    probe = ("import threading, time; from sluice.engine.core_client import single_threaded; "
             "a = single_threaded(); t = threading.Thread(target=time.sleep, args=(0.5,)); "
             "t.start(); print(a, single_threaded())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert out.stdout.split() == ["True", "False"]


def test_messages_round_trip_through_msgpack() -> None:
    from sluice.engine.messages import Add, CoreRequest, SeqUpdate
    from sluice.engine.stats import EngineStats
    from sluice.protocol.errors import InvalidRequestError

    params = SamplingParams(n=2, temperature=0.5, stop=["x"], logprobs=2, seed=3,
                            output_kind=RequestOutputKind.DELTA, prompt_logprobs=1)
    add = Add(CoreRequest("r", [1, 2], params, 3, 12.5, 7))
    assert decode(encode(add)) == add
    assert decode(encode(Abort("r"))) == Abort("r")
    out = CoreOutputs([SeqUpdate("r", 1, [5], [{5: -0.1, 6: -2.0}], -0.1, "stop", 5, 16, 1.0),
                       SeqUpdate("p", 0, [7], prompt_logprobs=[None, {2: -1.5, 9: -0.2}])],
                      EngineStats(1, 2, 0.5, 64, 10, 4, 0, 20, 30, 5),
                      [("q", InvalidRequestError("dup", param="request_id"))])
    back = decode(encode(out))
    assert isinstance(back, CoreOutputs)
    assert back.updates == out.updates and back.stats == out.stats
    (rid, err), = back.errors
    assert rid == "q" and isinstance(err, InvalidRequestError) and err.param == "request_id"


def test_an_unwritable_step_log_fails_the_start_with_its_own_error(tiny_llama_dir: Path,
                                                                    tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    config = EngineConfig.from_options(str(tiny_llama_dir), **OPTIONS,
                                       step_log=str(tmp_path / "file" / "steps"))
    core = ProcessCore(config)
    with pytest.raises(CoreDied, match="cannot write the step log in .*file/steps"):
        core.wait_ready()
    assert not core.process.is_alive()


@pytest.mark.parametrize("endpoint", ["notazmq", "tcp://999.1.1.1:5"])
def test_a_kv_events_endpoint_that_does_not_bind_fails_the_start(tiny_llama_dir: Path,
                                                                  endpoint: str) -> None:
    """Found by a new-user pass: the worker said it was listening, then the core died with
    zmq's traceback at its first loop (the publisher was bound after Ready)."""
    config = EngineConfig.from_options(str(tiny_llama_dir), **OPTIONS)
    core = ProcessCore(config, endpoint)
    with pytest.raises(CoreDied, match="cannot publish KV events on") as died:
        core.wait_ready()
    # the setting's name crosses the process boundary: the worker names its flag, where it
    # said 'failed to load the model' (found by the docs pass)
    assert died.value.param == "kv_events_endpoint"
    core.process.join(timeout=10)
    assert not core.process.is_alive()
