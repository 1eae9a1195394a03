"""`sluice deploy k8s --render DIR`: write the Kubernetes manifests (see control/k8s.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from sluice.control.k8s import K8sOptions

    d = K8sOptions()
    p = subparsers.add_parser("deploy", help="deployment manifests (Kubernetes + KEDA)")
    targets = p.add_subparsers(dest="target", metavar="TARGET", required=True)
    k8s = targets.add_parser("k8s", help="render gateway, router, workers, PDBs and a KEDA "
                                         "ScaledObject on sluice:desired_replicas")
    k8s.add_argument("--render", required=True, metavar="DIR", type=Path,
                     help="directory to write the YAML files into (created)")
    k8s.add_argument("--model", default=None,
                     help="what workers load: a path or hub id in the image (default: the "
                          "image's bundled SmolLM2-135M-Instruct Q4_1 GGUF, served as "
                          f"{d.served_name})")
    k8s.add_argument("--served-model-name", default=None,
                     help="the model id clients use (default: derived from --model)")
    k8s.add_argument("--image", default=d.image, help="container image (default: %(default)s)")
    k8s.add_argument("--namespace", default=d.namespace, help="(default: %(default)s)")
    k8s.add_argument("--min-workers", type=int, default=d.min_workers,
                     help="KEDA minReplicaCount; 0 scales to zero (default: %(default)s)")
    k8s.add_argument("--max-workers", type=int, default=d.max_workers,
                     help="KEDA maxReplicaCount (default: %(default)s)")
    k8s.add_argument("--slo", default=d.slo, help="the planner's SLO (default: %(default)s)")
    k8s.add_argument("--prometheus-url", default=d.prometheus_url,
                     help="where KEDA queries sluice:desired_replicas (default: %(default)s)")
    k8s.add_argument("--worker-cpu", default=d.worker_cpu, metavar="CPU",
                     help="a worker's CPU request (its --cpu-threads: whole cores) "
                          "(default: %(default)s)")
    k8s.add_argument("--worker-memory", default=d.worker_memory, metavar="MEM",
                     help="a worker's memory request and limit; a quarter of it is its KV "
                          "cache (--kv-cache-memory-bytes) (default: %(default)s)")
    k8s.add_argument("--drain-seconds", type=int, default=d.drain_seconds,
                     help="a stopping worker's time to finish its streams (default: %(default)s)")
    k8s.set_defaults(func=render_k8s)


K8S_FLAGS = {  # K8sOptions field -> the flag that sets it
    "model": "--model", "served_name": "--served-model-name", "image": "--image",
    "namespace": "--namespace", "min_workers": "--min-workers", "max_workers": "--max-workers",
    "slo": "--slo", "prometheus_url": "--prometheus-url", "drain_seconds": "--drain-seconds",
    "worker_cpu": "--worker-cpu", "worker_memory": "--worker-memory",
}


def render_k8s(args: argparse.Namespace) -> int:
    from sluice.control.flags import named_by_flags
    from sluice.control.k8s import DEFAULT_SERVED_NAME, K8sOptions, write
    from sluice.control.planner import SLO
    from sluice.protocol.errors import InvalidRequestError

    name = args.served_model_name or (
        args.model.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf") if args.model
        else DEFAULT_SERVED_NAME)
    try:
        named_by_flags(lambda: SLO.parse(args.slo), K8S_FLAGS)
        options = named_by_flags(lambda: K8sOptions(
            model=args.model, served_name=name, image=args.image, namespace=args.namespace,
            min_workers=args.min_workers, max_workers=args.max_workers, slo=args.slo,
            prometheus_url=args.prometheus_url, worker_cpu=args.worker_cpu,
            worker_memory=args.worker_memory, drain_seconds=args.drain_seconds), K8S_FLAGS)
    except InvalidRequestError as exc:
        derived = exc.param == "served_model_name" and args.served_model_name is None
        return fail(str(exc) + (" (derived from --model: name it with --served-model-name)"
                                if derived else ""))
    try:
        paths = write(options, args.render)
    except OSError as exc:  # a file in the way, no such parent, no permission
        return fail(f"cannot write the manifests into {str(args.render)!r}: "
                    f"{exc.strerror or exc}")
    for path in paths:
        print(path)
    return 0


def fail(message: str) -> int:
    print(f"sluice deploy k8s: error: {message}", file=sys.stderr)
    return 2
