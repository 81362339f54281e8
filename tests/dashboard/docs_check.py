#!/usr/bin/python3
"""Checks the observability docs with Prometheus's own tools:
- docs/prometheus.yml passes `promtool check config`;
- every PromQL expression of docs/grafana-dashboard.json parses (`promtool check rules` on a
  rules file made of them, Grafana's $variables replaced by plain values);
- every tierkv_* series they name is one tierkvd exports (the names listed in daemon/http.c).
Usage: docs_check.py SOURCE_DIR PROMTOOL WORK_DIR
"""
import json
import os
import re
import subprocess
import sys


def main():
    src, promtool, work = sys.argv[1:4]
    os.makedirs(work, exist_ok=True)
    errors = []

    r = subprocess.run([promtool, "check", "config", os.path.join(src, "docs/prometheus.yml")],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        errors.append("promtool check config: " + r.stdout.decode())

    dash = json.load(open(os.path.join(src, "docs/grafana-dashboard.json")))
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    if len(exprs) < 10:
        errors.append(f"only {len(exprs)} expressions in the Grafana dashboard")
    rules = ["groups:", "  - name: grafana_dashboard", "    rules:"]
    for i, e in enumerate(exprs):
        e = e.replace("$__rate_interval", "1m").replace("$instance", ".*")
        rules.append(f"      - record: tierkv_dashboard_expr_{i}")
        rules.append("        expr: " + json.dumps(e))
    path = os.path.join(work, "grafana_exprs.rules.yml")
    open(path, "w").write("\n".join(rules) + "\n")
    r = subprocess.run([promtool, "check", "rules", path], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT)
    if r.returncode != 0:
        errors.append("promtool check rules (Grafana expressions): " + r.stdout.decode())

    http_c = open(os.path.join(src, "daemon/http.c")).read()
    exported = set(re.findall(r'"(tierkv_[a-z0-9_]+)"', http_c))
    exported |= {n + s for n in exported for s in ("_bucket", "_sum", "_count")}
    used = set(re.findall(r"\btierkv_[a-z0-9_]+", " ".join(exprs)))
    used |= set(re.findall(r"\btierkv_[a-z0-9_]+", open(os.path.join(src, "docs/observability.md")).read()))
    missing = sorted(n for n in used if n not in exported)
    if missing:
        errors.append("series named in the docs but not exported: " + ", ".join(missing))

    if errors:
        print("\n".join("FAIL: " + e for e in errors))
        return 1
    print(f"docs ok: prometheus.yml valid, {len(exprs)} Grafana expressions parse, "
          f"{len(used)} series names all exported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
