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
        + ["ScaledObject"] + ["Service"] * 3
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
        'max(sluice:desired_replicas{pool="SmolLM2-135M-Instruct"})'
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
    assert router[router.index("--worker-url") + 1] == \
        "http://sluice-worker-smollm2-135m-instruct:8000"


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


def test_bad_options_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["deploy", "k8s", "--render", str(tmp_path), "--min-workers", "5",
                 "--max-workers", "2"]) == 2
    assert "min_workers <= max_workers" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.yaml"))
