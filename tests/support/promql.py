"""Metric names: which ones a PromQL expression, a Grafana dashboard or a rule file uses, and
which ones a daemon's ``/metrics`` page declares; the checks that compare them.

The deploy tests hold the shipped dashboard and alert rules to the daemon's metrics with these;
the end-to-end metrics test runs `dashboard_metrics_missing_from_scrape` on a live daemon.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.support import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "kvsidecar.json"
RULES = ROOT / "deploy" / "prometheus" / "kvsidecar-rules.yaml"

PROMETHEUS_SYNTHETIC: frozenset[str] = frozenset({"up"})
"""Series Prometheus adds to every scrape target itself."""

_PROMQL_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
    | {"group_left", "group_right", "inf", "nan", "start", "end"}
)


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (Grafana ``$variables`` allowed).

    Good enough for the expressions we write: strings, label matchers, ranges and grouping
    clauses are removed first; what is left that is neither a function, an aggregation, a
    keyword nor a number is a metric name.
    """
    s = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)
    names = set()
    for match in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", s):
        token = match.group(0)
        if token.lower() in _PROMQL_KEYWORDS:
            continue
        if re.match(r"\s*\(", s[match.end() :]):  # function call or aggregation
            continue
        names.add(token)
    return names


def _split_args(text: str) -> list[str]:
    """Split a function's argument text at top-level commas."""
    args, depth, current = [], 0, ""
    for char in text:
        if char in "({[":
            depth += 1
        elif char in ")}]":
            depth -= 1
        if char == "," and depth == 0:
            args.append(current)
            current = ""
        else:
            current += char
    args.append(current)
    return [a.strip() for a in args]


def template_query_names(query: str) -> set[str]:
    """Metric names in a Grafana template variable query (``label_values(metric, label)``...)."""
    match = re.fullmatch(r"\s*(label_values|query_result)\((.*)\)\s*", query, re.DOTALL)
    if match is None:
        return promql_metric_names(query) if query.strip() else set()
    args = _split_args(match.group(2))
    if match.group(1) == "label_values" and len(args) == 1:
        return set()  # label_values(label): no metric
    return promql_metric_names(args[0])


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def dashboard_queries(path: Path = DASHBOARD) -> list[str]:
    """Every PromQL expression of a dashboard's panels (rows and nested panels included)."""
    dashboard = json.loads(path.read_text())
    return [
        node["expr"]
        for node in _walk(dashboard.get("panels", []))
        if isinstance(node.get("expr"), str)
    ]


def dashboard_metric_names(path: Path = DASHBOARD) -> set[str]:
    """Every metric name used by every query of a Grafana dashboard: panels and variables."""
    dashboard = json.loads(path.read_text())
    names: set[str] = set()
    for expr in dashboard_queries(path):
        names |= promql_metric_names(expr)
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query", "")
        names |= template_query_names(str(query))
    return names


def rule_metric_names(path: Path = RULES) -> set[str]:
    """Every metric name used by the expressions of a Prometheus rule file."""
    groups = yaml.safe_load(path.read_text())["groups"]
    return {n for g in groups for r in g["rules"] for n in promql_metric_names(r["expr"])}


def scraped_metric_names(exposition: str) -> set[str]:
    """Sample names a ``/metrics`` page declares, from its ``# TYPE`` lines and samples.

    Uses the families, not only the samples, so that a labelled counter that has not counted
    anything yet (no samples) still counts as exported.
    """
    from prometheus_client.parser import text_string_to_metric_families

    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "summary": ("_sum", "_count"),
        "info": ("_info",),
    }
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def dashboard_metrics_missing_from_scrape(exposition: str, path: Path = DASHBOARD) -> set[str]:
    """Metric names the dashboard queries that a live daemon's ``/metrics`` page lacks.

    For the end-to-end test against a running daemon: scrape its ``/metrics`` and assert this is
    empty. ``up`` is added by Prometheus, not by the daemon, and is not required.
    """
    return dashboard_metric_names(path) - scraped_metric_names(exposition) - PROMETHEUS_SYNTHETIC


def rules_metrics_missing_from_scrape(exposition: str, path: Path = RULES) -> set[str]:
    """The same check for the alert rules."""
    return rule_metric_names(path) - scraped_metric_names(exposition) - PROMETHEUS_SYNTHETIC
