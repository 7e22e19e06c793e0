"""The connector against vLLM's own configuration and interface, for every tested vLLM.

- The ``--kv-transfer-config`` of every Kubernetes example and of docs/vllm.md's recipe, loaded
  with vLLM's ``KVTransferConfig`` and the connector's settings parser: a pod started from an
  example gets the connector, not an error at start.
- The connector started on engine configs made by vLLM's ``EngineArgs``: what cannot work
  (pipeline or decode context parallelism, non-causal attention, sleep mode, hybrid SSM
  models) is refused with the reason; a sliding-window model is served with a
  warning;
  ``kv_load_failure_policy`` other than ``recompute`` is warned about; the namespace's
  fingerprint changes with what changes a block's bytes and with nothing else.
- The connector's hooks against ``KVConnectorBase_V1`` of each tested vLLM and of the newest
  release (its source, from the wheel ``scripts/fetch-vllm-source`` downloads: it needs a CUDA
  build of torch to run): every abstract method implemented, every overridden one with the
  base's parameters.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT, python_env
from tests.support.deploy import K8S, yaml_documents
from tests.support.vllm_serve import VLLM_VENVS, make_model, vllm_venv_params

pytestmark = pytest.mark.timeout(600)

NEWEST = "0.34.0"
"""The newest vLLM release on the package index, whose interface the hooks are checked against."""
NEWEST_WHEEL = ROOT / ".cache" / "vllm-wheels"
"""Where ``scripts/fetch-vllm-source`` puts its wheel."""


def _helper(venv: Path, *args: str, timeout: float = 300) -> Any:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "tests.procs.vllm_configs", *args],
        cwd=ROOT,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _example_configs() -> dict[str, str]:
    """Every ``--kv-transfer-config`` of the Kubernetes examples and of docs/vllm.md."""
    found: dict[str, str] = {}
    for path, doc in yaml_documents(sorted((K8S / "examples").glob("*.yaml"))):
        if doc["kind"] != "Pod":
            continue
        for container in doc["spec"]["containers"]:
            args = [str(a) for a in container.get("args", [])]
            if "--kv-transfer-config" in args:
                found[f"{path.name}:{container['name']}"] = args[
                    args.index("--kv-transfer-config") + 1
                ]
    docs = (ROOT / "docs" / "vllm.md").read_text()
    for i, m in enumerate(re.finditer(r"--kv-transfer-config '(\{.*?\})'", docs, re.S)):
        found[f"docs/vllm.md:{i}"] = m.group(1)
    return found


def test_every_example_names_an_engine_with_the_connector() -> None:
    configs = _example_configs()
    assert {k.split(":")[0] for k in configs} >= {
        "engine-pod-daemonset.yaml",
        "engine-pod-sidecar.yaml",
        "engine-pod-sidecar-dra.yaml",
        "docs/vllm.md",
    }
    # The YAML scalars are what the container gets: one JSON document each.
    for name, text in configs.items():
        assert isinstance(json.loads(text), dict), name


@pytest.mark.parametrize("venv", vllm_venv_params(engines=False))
def test_the_examples_load_with_vllms_kv_transfer_config(venv: Path) -> None:
    configs = _example_configs()
    results = _helper(venv, "transfer", json.dumps(list(configs.values())))
    for name, result in zip(configs, results, strict=True):
        assert result == {
            "class": "kvsidecar.integrations.vllm.connector.KVSidecarConnector",
            "role": "kv_both",
            "policy": "recompute",
            "endpoint": "",  # the daemon found through KVSIDECAR_RUNTIME_DIR, as the pod sets
        }, (name, result)


@pytest.mark.parametrize("venv", vllm_venv_params())  # it starts engines
def test_what_cannot_work_is_refused_at_start_and_the_namespace_follows_the_bytes(
    venv: Path, tmp_path: Path
) -> None:
    make_model(venv, tmp_path / "model")
    started = _helper(venv, "start", str(tmp_path / "model"))
    for case, why in (
        ("pipeline parallel", "pipeline parallelism (2 stages) is not supported"),
        ("decode context parallel", "decode context parallelism (2 ranks) is not supported"),
        ("non-causal", "encoder_only attention, whose prefixes vLLM does not cache"),
        ("sleep mode", "sleep mode (--enable-sleep-mode) is not supported"),
        ("hybrid SSM", "is a hybrid model with state-space (Mamba) layers"),
    ):
        assert why in started[case].get("refused", ""), (case, started[case])
    warned = [w for w in started["policy fail"]["warnings"] if "kv_load_failure_policy" in w]
    assert warned and "'fail'" in warned[0], started["policy fail"]
    assert not any("kv_load_failure_policy" in w for w in started["plain"]["warnings"])
    # Served, with the cost said: vLLM's hybrid manager is off, the window keeps every token.
    (said,) = [w for w in started["sliding window"]["warnings"] if "sliding-window" in w]
    assert "window 64" in said, said
    assert not any("sliding-window" in w for w in started["plain"]["warnings"])
    for case in ("MLA", "MLA under TP"):  # the latent is stored once, whatever the TP
        assert "fingerprint" in started[case], started[case]
    plain = started["plain"]["fingerprint"]
    for case in ("longer context", "another seed", "policy fail"):
        assert started[case]["fingerprint"] == plain, case  # a block's bytes are the same
    for case in ("hf_overrides", "fp8 cache", "block size 64"):
        assert started[case]["fingerprint"] != plain, case


# ------------------------------------------------------------------ the hooks


def _methods(source: str, cls: str) -> dict[str, tuple[list[tuple[str, str]], bool, bool]]:
    """A class's methods: ``name -> ([(parameter, kind)], is abstract, is a classmethod)``."""
    tree = ast.parse(source)
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    out = {}
    for fn in node.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        a = fn.args
        params = [(p.arg, "positional") for p in [*a.posonlyargs, *a.args]]
        params += [(a.vararg.arg, "*")] if a.vararg else []
        params += [(p.arg, "keyword") for p in a.kwonlyargs]
        params += [(a.kwarg.arg, "**")] if a.kwarg else []
        names = {ast.unparse(d) for d in fn.decorator_list}
        out[fn.name] = (params, "abstractmethod" in names, "classmethod" in names)
    return out


def _base_sources() -> list[Any]:
    rel = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
    params = []
    for minor, venv in VLLM_VENVS.items():
        found = sorted(venv.glob(f"lib/python*/site-packages/{rel}"))
        params.append(
            pytest.param(
                found[0] if found else None,
                id=minor,
                marks=pytest.mark.skipif(not found, reason=f"no {venv.name}"),
            )
        )
    wheels = sorted(NEWEST_WHEEL.glob(f"vllm-{NEWEST}-*.whl"))
    params.append(
        pytest.param(
            (wheels[0], rel) if wheels else None,
            id=NEWEST,
            marks=pytest.mark.skipif(not wheels, reason="no wheel (scripts/fetch-vllm-source)"),
        )
    )
    return params


@pytest.mark.parametrize("base", _base_sources())
def test_the_hooks_match_kv_connector_base_v1(base: Any) -> None:
    if isinstance(base, tuple):
        with zipfile.ZipFile(base[0]) as wheel:
            source = wheel.read(base[1]).decode()
    else:
        source = Path(base).read_text()
    theirs = _methods(source, "KVConnectorBase_V1")
    ours = _methods(
        (ROOT / "kvsidecar" / "integrations" / "vllm" / "connector.py").read_text(),
        "KVSidecarConnector",
    )
    missing = [n for n, (_, abstract, _) in theirs.items() if abstract and n not in ours]
    assert not missing, f"abstract hooks not implemented: {missing}"
    for name, (params, _, is_class) in ours.items():
        if name.startswith("_") or name not in theirs:
            continue
        want, _, want_class = theirs[name]
        assert is_class == want_class, name
        # The same parameters, in order, of the same kinds; **kwargs of ours may take more.
        named = [p for p in params if p[1] != "**"]
        assert named == [p for p in want if p[1] != "**"], (name, params, want)
