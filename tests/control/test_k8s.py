"""`sluice deploy k8s --render DIR`: every manifest passes schema validation.

Core kinds (Namespace, Deployment, Service, PodDisruptionBudget) are validated by
`kubernetes-validate` in strict mode (unknown fields rejected) against the Kubernetes
1.30 OpenAPI schemas it ships. The KEDA ScaledObject, a CRD that package does not
know, is validated with `jsonschema` against KEDA's CRD schema written into
`data/keda-scaledobject-v1alpha1.schema.yaml` (stricter than the API server: unknown
fields fail). No cluster is involved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from sluice.cli import main
from sluice.control.k8s import K8sOptions, render, scaled_object

KEDA_SCHEMA = Path(__file__).parent / "data" / "keda-scaledobject-v1alpha1.schema.yaml"
K8S_VERSION = "1.30.0"


def rendered(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    assert main(["deploy", "k8s", "--render", str(tmp_path), *args]) == 0
    return [doc for path in sorted(tmp_path.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text())]


def keda_validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(yaml.safe_load(KEDA_SCHEMA.read_text()))


def test_every_rendered_manifest_validates(tmp_path: Path) -> None:
    docs = rendered(tmp_path, "--min-workers", "0", "--max-workers", "6",
                    "--slo", "ttft=1s,itl=100ms")
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Deployment"] * 3 + ["Namespace"] + ["PodDisruptionBudget"] * 2 \
        + ["ScaledObject"] + ["Service"] * 4
    for doc in docs:
        if doc["kind"] == "ScaledObject":
            keda_validator().validate(doc)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    (so,) = [d for d in docs if d["kind"] == "ScaledObject"]
    assert so["spec"]["minReplicaCount"] == 0 and so["spec"]["maxReplicaCount"] == 6
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["query"] == \
        'max(sluice:desired_replicas{pool="SmolLM2-135M-Instruct.Q4_1"})'
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    worker_spec = deployments[so["spec"]["scaleTargetRef"]["name"]]["spec"]
    assert worker_spec["strategy"]["rollingUpdate"] == {"maxSurge": "100%", "maxUnavailable": 0}
    worker = worker_spec["template"]["spec"]
    (c,) = worker["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]
    assert worker["terminationGracePeriodSeconds"] > 60  # --shutdown-timeout 60 fits
    router = deployments["sluice-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert router[router.index("--slo") + 1] == "ttft=1s,itl=100ms"
    # the router resolves a headless Service: each ready pod is a worker of its own
    (ns,) = {d["metadata"]["namespace"] for d in docs if d["kind"] == "Deployment"}
    assert router[router.index("--worker-dns") + 1] == \
        f"http://sluice-worker-smollm2-135m-instruct-q4-1-pods.{ns}.svc:8000"
    services = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Service"}
    pods = services["sluice-worker-smollm2-135m-instruct-q4-1-pods"]
    assert pods["clusterIP"] == "None" and pods["selector"] == worker_spec["selector"]["matchLabels"]


def test_the_default_render_loads_the_bundled_model_under_its_served_name(
        tmp_path: Path) -> None:
    """Without --model, workers and router start without one (the image's bundled GGUF:
    `SmolLM2-135M-Instruct` is no name `--model` can load), and the served name and the
    pool label are the name that model is served under, as `sluice serve` names it."""
    from sluice.engine.tokenizer import default_served_name

    docs = rendered(tmp_path)
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    name = default_served_name(None)
    assert name == "SmolLM2-135M-Instruct.Q4_1"
    worker = deployments["sluice-worker-smollm2-135m-instruct-q4-1"]
    (w,) = worker["spec"]["template"]["spec"]["containers"]
    (r,) = deployments["sluice-router"]["spec"]["template"]["spec"]["containers"]
    assert "--model" not in w["args"] and "--model" not in r["args"]
    assert w["args"][w["args"].index("--served-model-name") + 1] == name
    (so,) = [d for d in docs if d["kind"] == "ScaledObject"]
    assert so["spec"]["triggers"][0]["metadata"]["query"] == \
        f'max(sluice:desired_replicas{{pool="{name}"}})'
    given = rendered(tmp_path / "given", "--model", "/models/Qwen2-0.5B.Q4_0.gguf")
    (w,) = [d for d in given if d["kind"] == "Deployment"
            and d["metadata"]["name"].startswith("sluice-worker")][0]["spec"]["template"][
        "spec"]["containers"]
    assert w["args"][1:5] == ["--model", "/models/Qwen2-0.5B.Q4_0.gguf",
                              "--served-model-name", "Qwen2-0.5B.Q4_0"]


def test_router_probes_are_on_liveness_so_a_pool_at_zero_keeps_its_router(
        tmp_path: Path) -> None:
    """The router's /health is 503 with no healthy worker: probed there, at zero workers
    it would leave its Service (no request held, the pool never wakes) and be restarted
    during every cold start. Its probes are on /liveness; the workers' stay on /health."""
    docs = rendered(tmp_path, "--min-workers", "0")
    containers = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
                  for d in docs if d["kind"] == "Deployment"}
    router = containers["sluice-router"]
    assert router["readinessProbe"]["httpGet"]["path"] == "/liveness"
    assert router["livenessProbe"]["httpGet"]["path"] == "/liveness"
    worker = containers["sluice-worker-smollm2-135m-instruct-q4-1"]
    assert {worker[p]["httpGet"]["path"] for p in
            ("startupProbe", "readinessProbe", "livenessProbe")} == {"/health"}
    # the gateways pass /health to the router: probed there, at zero workers they left
    # their Service and no request reached the router to wake the pool
    gateway = containers["sluice-gateway"]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/liveness"
    assert "tcpSocket" in gateway["livenessProbe"]


def test_the_validators_reject_broken_manifests() -> None:
    """The checks can fail: a misspelt field, a wrong type, a missing trigger."""
    so = scaled_object(K8sOptions())
    so["spec"]["maxReplicas"] = 3
    with pytest.raises(jsonschema.ValidationError):
        keda_validator().validate(so)
    so = scaled_object(K8sOptions())
    del so["spec"]["triggers"]
    with pytest.raises(jsonschema.ValidationError):
        keda_validator().validate(so)
    deployment = render(K8sOptions())["10-workers.yaml"][0]
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    deployment = render(K8sOptions())["10-workers.yaml"][0]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


@pytest.mark.parametrize("argv, message", [
    (["--min-workers", "5", "--max-workers", "2"], "--min-workers must be <= --max-workers (2), got 5"),
    (["--min-workers", "-1"], "--min-workers must be >= 0, got -1"),
    (["--max-workers", "0"], "--max-workers must be >= 1, got 0"),
    (["--drain-seconds", "-1"], "--drain-seconds must be >= 0, got -1"),
    # each was a traceback (the Deployment's name is made while writing), or a manifest
    # the API server refuses, or a container that cannot start
    (["--served-model-name", "!!!"], "--served-model-name '!!!' has no letter or digit"),
    (["--model", "/models/+++"], "(derived from --model: name it with --served-model-name)"),
    (["--served-model-name", 'a"b'], "--served-model-name must not hold a double quote"),
    (["--namespace", "Bad_NS"], "--namespace must be a DNS-1123 label"),
    (["--image", ""], "--image must not be empty"),
    (["--model", " "], "--model must not be empty"),
    (["--prometheus-url", ""], "--prometheus-url must not be empty"),
    (["--slo", "ttft=0s"], "--slo: ttft must be a finite number > 0, got 0.0"),
])
def test_bad_options_exit_2_naming_the_flag(argv: list[str], message: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["deploy", "k8s", "--render", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert "_workers" not in err and "_name " not in err  # flags, not K8sOptions' fields
    assert not list(tmp_path.glob("*.yaml"))


def test_a_render_dir_that_cannot_be_made_exits_2(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A file in the way, or a missing parent: an error naming the directory, not
    mkdir's traceback."""
    (tmp_path / "file").write_text("")
    for target in (tmp_path / "file", tmp_path / "file" / "sub"):
        assert main(["deploy", "k8s", "--render", str(target)]) == 2
        assert f"cannot write the manifests into '{target}'" in capsys.readouterr().err


def test_router_and_workers_serve_the_pool_under_one_name(tmp_path: Path) -> None:
    """The router's pool, the workers' served name and KEDA's `pool` label are one name:
    the router is given `--served-model-name` too. Before, it derived its own from
    `--model` (a hub id's full name, where the workers were told its last part; a given
    `--served-model-name` only reached the workers), so it answered 404 for the model the
    workers served and the planner's gauge carried a label KEDA never queried."""
    from sluice.cli import build_parser
    from sluice.serve import pool_name

    cases = [(["--model", "meta-llama/Llama-3.2-1B"], "Llama-3.2-1B"),
             (["--model", "/models/qwen", "--served-model-name", "chat"], "chat")]
    for i, (flags, name) in enumerate(cases):
        docs = rendered(tmp_path / str(i), *flags)
        containers = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
                      for d in docs if d["kind"] == "Deployment"}
        (worker,) = [c for n, c in containers.items() if n.startswith("sluice-worker")]
        router = containers["sluice-router"]["args"]
        assert worker["args"][worker["args"].index("--served-model-name") + 1] == name
        served = pool_name(build_parser(router).parse_args(router))
        assert served == name
        (so,) = [d for d in docs if d["kind"] == "ScaledObject"]
        assert so["spec"]["triggers"][0]["metadata"]["query"] == \
            f'max(sluice:desired_replicas{{pool="{name}"}})'


def test_pods_are_sized_to_their_requests_not_to_the_node(tmp_path: Path) -> None:
    """A worker sizes its KV pool from the machine's RAM (a tenth, up to 4 GiB) and its
    CPU threads from the machine's cores; in a pod both are the node's, so on a 32 GiB
    node the default worker allocated 3.2 GiB of KV cache against its 2Gi limit
    (OOMKilled before ready) and ran an OpenMP thread per node core beside its
    neighbours. The render passes both from the pod's requests; router and gateway
    carry requests too (without, they were BestEffort: the first pods evicted)."""
    from sluice.cli import build_parser
    from sluice.worker.cli import engine_config

    for flags, threads, kv in [([], 2, 512 * 2**20),
                               (["--worker-cpu", "1500m", "--worker-memory", "8Gi"], 1, 2**31)]:
        docs = rendered(tmp_path / str(threads), *flags)
        pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
                for d in docs if d["kind"] == "Deployment"}
        (worker,) = [c for n, c in pods.items() if n.startswith("sluice-worker")]
        config = engine_config(build_parser(worker["args"]).parse_args(worker["args"]))
        assert config.model.cpu_threads == threads
        assert config.cache.kv_cache_memory_bytes == kv
        assert kv <= worker_limit(worker) // 4
        for name in ("sluice-router", "sluice-gateway"):
            assert set(pods[name]["resources"]["requests"]) == {"cpu", "memory"}
        for doc in docs:
            if doc["kind"] != "ScaledObject":
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def worker_limit(container: dict[str, Any]) -> int:
    from sluice.control.k8s import memory_bytes

    return memory_bytes(container["resources"]["limits"]["memory"])


@pytest.mark.parametrize("argv, message", [
    (["--worker-cpu", "0"], "--worker-cpu must be a CPU quantity"),
    (["--worker-cpu", "two"], "--worker-cpu must be a CPU quantity"),
    (["--worker-memory", "2GB"], "--worker-memory must be a memory quantity"),
    (["--worker-memory", "100Mi"], "of at least 256Mi"),
])
def test_bad_worker_sizes_exit_2(argv: list[str], message: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["deploy", "k8s", "--render", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_worker_deployment_leaves_its_replicas_to_keda(tmp_path: Path) -> None:
    """With `spec.replicas` in the worker Deployment, every `kubectl apply` of the
    rendered files (how a model rollout is done: a new --model in its args) set the pool
    back to that count (min-workers), draining the workers the planner had added under
    load until KEDA's next poll; Kubernetes' HPA docs say to leave it out. Router and
    gateway keep theirs."""
    docs = rendered(tmp_path, "--min-workers", "2", "--max-workers", "6")
    deployments = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Deployment"}
    assert "replicas" not in deployments["sluice-worker-smollm2-135m-instruct-q4-1"]
    assert deployments["sluice-router"]["replicas"] == 1
    assert deployments["sluice-gateway"]["replicas"] == 2
    (so,) = [d for d in docs if d["kind"] == "ScaledObject"]
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (2, 6)


def test_a_missing_planner_series_holds_the_count(tmp_path: Path) -> None:
    """KEDA's Prometheus scaler reads an empty result as 0 unless told otherwise
    (`ignoreNullValues`, default true). With no stabilization window (the planner's
    delays stand in for it), a router restart (its series gone until the new pod is
    scraped) scaled the workers to their minimum at once, under load. False makes the
    empty result an error, on which the HPA holds its count."""
    (so,) = [d for d in rendered(tmp_path, "--min-workers", "0") if d["kind"] == "ScaledObject"]
    (trigger,) = so["spec"]["triggers"]
    assert trigger["metadata"]["ignoreNullValues"] == "false"
    keda_validator().validate(so)
