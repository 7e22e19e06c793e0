"""The shipped deployment files as the tests read them: paths, YAML documents, the sidecar pod."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from tests.support import ROOT

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"

IMAGE = "ghcr.io/kvsidecar/kvsidecar"
"""The repository the Dockerfile's images are pushed to; tags are <version>-<torch variant>."""


def yaml_documents(paths: Iterable[Path]) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every non-empty YAML document of the given files."""
    for path in paths:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def sidecar_of(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The pod's kvsidecar native sidecar (an init container that keeps running), if any."""
    return next(
        (
            c
            for c in pod.get("initContainers", [])
            if c["image"].startswith(IMAGE + ":") and c.get("restartPolicy") == "Always"
        ),
        None,
    )


@dataclass(frozen=True)
class SidecarRuntime:
    """Where a sidecar pod's daemon keeps its sockets, as the manifest says."""

    volume: str
    """The volume both containers mount for it."""
    mount: str
    """Where both mount it."""
    runtime_dir: str
    """KVSIDECAR_RUNTIME_DIR of both containers: the daemon's runtime_dir, the engines' endpoint."""


def sidecar_runtime_dir(pod: dict[str, Any]) -> SidecarRuntime:
    """The runtime directory of a pod with a kvsidecar sidecar; the same in every container."""
    sidecar = sidecar_of(pod)
    assert sidecar is not None
    found = set()
    for container in [sidecar, *pod["containers"]]:
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        runtime_dir = env["KVSIDECAR_RUNTIME_DIR"]
        (mount,) = [
            m
            for m in container["volumeMounts"]
            if PurePosixPath(m["mountPath"]) in PurePosixPath(runtime_dir).parents
            or m["mountPath"] == runtime_dir
        ]
        found.add(SidecarRuntime(mount["name"], mount["mountPath"], runtime_dir))
    (runtime,) = found
    return runtime
