"""docs/grafana/dflash-runs.json: the fields Grafana needs to import it, and only metrics we export."""

import json
import re
from pathlib import Path

from dflash_ops.oncall import prometheus

DASHBOARD = Path(__file__).resolve().parents[2] / "docs/grafana/dflash-runs.json"
DATASOURCE = {"type": dict, "required": {"type": str, "uid": str}}
# A JSON-schema-like description of what Grafana's import reads: {"type", "required", "items"}.
SCHEMA = {"type": dict, "required": {
    "uid": str, "title": str, "schemaVersion": int,
    "time": {"type": dict, "required": {"from": str, "to": str}},
    "templating": {"type": dict, "required": {"list": {"type": list, "items": {"type": dict, "required": {
        "name": str, "type": str}}}}},
    "panels": {"type": list, "items": {"type": dict, "required": {
        "id": int, "type": str, "title": str, "datasource": DATASOURCE,
        "gridPos": {"type": dict, "required": {"x": int, "y": int, "w": int, "h": int}},
        "targets": {"type": list, "items": {"type": dict, "required": {
            "refId": str, "expr": str, "datasource": DATASOURCE}}}}}}}}


def violations(value, schema, where="$"):
    if isinstance(schema, type):
        schema = {"type": schema}
    if not isinstance(value, schema["type"]) or isinstance(value, bool):
        return [f"{where}: expected {schema['type'].__name__}, got {type(value).__name__}"]
    found = []
    for key, sub in schema.get("required", {}).items():
        found += (violations(value[key], sub, f"{where}.{key}") if key in value
                  else [f"{where}: missing {key}"])
    for i, item in enumerate(value if "items" in schema else []):
        found += violations(item, schema["items"], f"{where}[{i}]")
    return found


def test_the_validator_finds_what_grafana_would_reject():
    assert violations({"uid": "x"}, SCHEMA)[:2] == ["$: missing title", "$: missing schemaVersion"]
    bad = json.loads(DASHBOARD.read_text())
    bad["panels"][0]["gridPos"]["w"] = "12"
    del bad["panels"][1]["targets"][0]["expr"]
    assert violations(bad, SCHEMA) == ["$.panels[0].gridPos.w: expected int, got str",
                                       "$.panels[1].targets[0]: missing expr"]


def test_dashboard_is_valid_and_plots_the_metrics_we_export():
    board = json.loads(DASHBOARD.read_text())
    assert violations(board, SCHEMA) == []
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        grid = p["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    named = {m for e in exprs for m in re.findall(r"\bdflash_[a-z_]+", e)}
    assert named <= set(prometheus.FAMILIES), named - set(prometheus.FAMILIES)
    assert {"dflash_run_loss", "dflash_run_acceptance_length", "dflash_run_tokens_per_second",
            "dflash_gpu_utilization_percent"} <= named
    variables = {v["name"] for v in board["templating"]["list"]}
    used = {v for e in [json.dumps(panels)] for v in re.findall(r"\$\{?(\w+)", e)}
    assert used <= variables, used - variables
