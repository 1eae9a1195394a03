"""The `ray` backend on a 2-node Ray cluster on loopback (`ray.cluster_utils.Cluster`).

Two workers on the tiny model, one CPU each on two one-CPU nodes: Ray places one on
each node; both serve, the second with a `ModelSpec`'s flags over the backend's (as a
model swap starts its workers); removing a node kills its worker, which the backend then
reports DEAD (the controller would replace it). Marked `ray`: Ray's processes are
heavy for a 2-core machine; skipped where Ray is not installed.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from sluice.control.backend import ModelSpec, WorkerHealth  # noqa: E402

pytestmark = pytest.mark.ray


async def test_workers_spread_over_two_nodes_and_a_removed_node_is_dead(
        tiny_llama_dir: Path) -> None:
    from sluice.control.ray import RayBackend

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    second = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    backend = RayBackend(["--model", str(tiny_llama_dir), "--max-model-len", "256",
                          "--num-kv-blocks", "64"], address=cluster.address, num_cpus=1,
                         startup_timeout_s=200)
    try:
        a = await backend.start()
        b = await backend.start(ModelSpec(str(tiny_llama_dir), {"max_model_len": 128}))
        assert a.node != b.node, "one worker per one-CPU node"
        async with httpx.AsyncClient(timeout=60) as client:
            for worker, context in ((a, 256), (b, 128)):
                (card,) = (await client.get(worker.url + "/v1/models")).json()["data"]
                assert card["max_model_len"] == context
                resp = await client.post(worker.url + "/v1/completions", json={
                    "model": card["id"], "prompt": "hi", "max_tokens": 2})
                assert resp.status_code == 200, resp.text
        on_second = a if a.node == second.node_id else b
        other = b if on_second is a else a
        cluster.remove_node(second)
        assert await backend.health(on_second) is WorkerHealth.DEAD
        assert [w.id for w in backend.list()] == [other.id]
        assert await backend.health(other) is WorkerHealth.READY
    finally:
        await backend.close()
        ray.shutdown()
        cluster.shutdown()


def test_an_address_where_no_cluster_answers_is_refused_at_once(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`sluice serve --backend ray --ray-address 127.0.0.1:1` hung (Ray retries the GCS
    for minutes, 2 min here before it was killed), and `--ray-address auto` with no
    cluster running was ConnectionError's traceback: both exit 2 naming the flag, and
    no Ray is started."""
    import time

    from sluice.cli import main
    from sluice.control.local import free_port
    from sluice.control.ray import join
    from sluice.protocol.errors import InvalidRequestError

    closed = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    for address in (closed, f"ray://{closed}"):
        with pytest.raises(InvalidRequestError, match="no Ray cluster answers there") as err:
            join(address)
        assert err.value.param == "address"
    with pytest.raises(InvalidRequestError, match="must be HOST:PORT"):
        join("head-node")
    assert time.monotonic() - started < 10 and not ray.is_initialized()

    def no_cluster(**_: object) -> None:
        raise ConnectionError("Could not find any running Ray instance. Please specify ...")

    monkeypatch.setattr(ray, "init", no_cluster)
    with pytest.raises(InvalidRequestError, match="'auto': cannot join a Ray cluster: "
                                                  "Could not find any running Ray instance$"):
        join("auto")
    monkeypatch.undo()
    assert main(["serve", "--no-gateway", "--backend", "ray", "--ray-address", closed,
                 "--workers", "1"]) == 2
    err_text = capsys.readouterr().err
    assert f"--ray-address '{closed}': no Ray cluster answers there" in err_text


def test_a_request_no_node_could_hold_is_told_from_a_busy_cluster() -> None:
    from sluice.control.ray import unplaceable

    def node(alive: bool = True, **resources: float) -> dict[str, object]:
        return {"Alive": alive, "Resources": {"memory": 1e9, **resources}}

    two = [node(CPU=2.0), node(CPU=4.0, GPU=1.0), node(alive=False, CPU=64.0, GPU=8.0)]
    assert unplaceable({"CPU": 4.0, "GPU": 1.0}, two) is None  # fits node 2, idle or not
    assert unplaceable({"CPU": 2.0, "GPU": 0.0}, two) is None
    assert unplaceable({"CPU": 8.0, "GPU": 0.0}, two) == \
        "a worker asks 8 CPU: no node of the Ray cluster has that many " \
        "(its 2 nodes have at most 4 each)"
    assert unplaceable({"CPU": 1.0, "GPU": 2.0}, two) == \
        "a worker asks 2 GPU: no node of the Ray cluster has that many " \
        "(its 2 nodes have at most 1 each)"
    split = [node(CPU=8.0), node(CPU=1.0, GPU=1.0)]
    assert unplaceable({"CPU": 4.0, "GPU": 1.0}, split) == \
        "a worker asks 4 CPU and 1 GPU: no node of the Ray cluster has them together " \
        "(its 2 nodes)"


@ray.remote
class Holder:
    """Holds its CPUs while it lives (the cluster is busy, not too small)."""

    def ready(self) -> bool:
        return True


async def test_a_worker_too_big_for_every_node_fails_at_once_a_busy_one_waits(
        tiny_llama_dir: Path) -> None:
    """Two one-CPU nodes: a worker asking 2 CPUs (the cluster's sum, but no node's) waited
    out the whole startup timeout (300 s by default, 30 s here) as a pending actor; now its start
    fails at once naming the resource. A worker that fits but finds both nodes busy
    still waits, up to the timeout."""
    import time

    from sluice.control.ray import RayBackend

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    args = ["--model", str(tiny_llama_dir), "--max-model-len", "256"]
    big = RayBackend(args, address=cluster.address, num_cpus=2, startup_timeout_s=30)
    fits = RayBackend(args, address=cluster.address, num_cpus=1, startup_timeout_s=3)
    holders = [Holder.options(num_cpus=1).remote() for _ in range(2)]
    try:
        ray.get([h.ready.remote() for h in holders], timeout=60)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"^a worker asks 2 CPU: no node of the Ray "
                                               r"cluster has that many \(its 2 nodes have "
                                               r"at most 1 each\)$"):
            await big.start()
        assert time.monotonic() - started < 5 and not big.list()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await fits.start()
        assert time.monotonic() - started >= 3 and not fits.list()
    finally:
        for backend in (big, fits):
            await backend.close()
        ray.shutdown()
        cluster.shutdown()
