#!/usr/bin/env python3
"""Render deploy/kubernetes/prometheusrule.yaml from deploy/prometheus/kvsidecar-rules.yaml.

The plain rule file is the source: promtool checks and unit-tests it. The PrometheusRule for the
Prometheus Operator carries the same groups under ``spec``, comments included.

    python3 deploy/prometheus/render_prometheusrule.py          # rewrite the PrometheusRule
    python3 deploy/prometheus/render_prometheusrule.py --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RULES = HERE / "kvsidecar-rules.yaml"
TARGET = HERE.parent / "kubernetes" / "prometheusrule.yaml"

HEADER = """\
---
# GENERATED from deploy/prometheus/kvsidecar-rules.yaml by
# deploy/prometheus/render_prometheusrule.py: edit the rule file, then re-run the script.
#
# The Prometheus Operator loads this resource when its labels match the Prometheus `ruleSelector`
# (kube-prometheus-stack: `release: <helm release name>`); adjust them to your installation.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: kvsidecar
  namespace: kvsidecar
  labels:
    app.kubernetes.io/name: kvsidecar
    app.kubernetes.io/component: alerting
    release: kube-prometheus-stack
spec:
"""


def render(rules_text: str) -> str:
    """Render the PrometheusRule text: the rule file from ``groups:`` on, indented under spec."""
    lines = rules_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("groups:"))
    body = ["  " + line if line.strip() else "" for line in lines[start:]]
    return HEADER + "\n".join(body) + "\n"


def main(argv: list[str]) -> int:
    """Write the PrometheusRule, or with ``--check`` report whether it is current."""
    text = render(RULES.read_text())
    if "--check" in argv:
        if TARGET.read_text() != text:
            print(f"{TARGET} is out of date; run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
