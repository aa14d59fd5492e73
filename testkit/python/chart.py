"""Drives the real Helm SDK (PyPI helm-python-sdk, Helm v4's Go code) for testkit/src/chart.rs.

  chart.py render CHART VALUES NAMESPACE OUT   render templates (as `helm install`) into OUT, one
                                               multi-document YAML; prints a line per object
  chart.py lint CHART VALUES NAMESPACE KUBEVER `helm lint --strict`; prints each message; exits 1
                                               on any error or warning
  chart.py crds CHART OUT                      the CRD files Helm installs from the chart's crds/,
                                               as Helm loads them, into OUT (one file each)

VALUES is a YAML file merged over the chart's values.yaml (as `-f VALUES`). A failed render or
schema check prints Helm's message and exits 2.
"""

import os
import sys

import helm_python as helm
import yaml

# Helm's message severities (chart/lint/support): 1 info, 2 warning, 3 error.
SEVERITY = {1: "INFO", 2: "WARNING", 3: "ERROR"}


def values(path):
    with open(path) as f:
        return yaml.safe_load(f) or {}


def main():
    cmd, chart_dir, *rest = sys.argv[1:]
    if cmd == "render":
        vals, namespace, out = rest
        chart = helm.Chart.load(chart_dir)
        try:
            rendered = chart.render(values(vals), name="ferrite", namespace=namespace, is_install=True)
        except helm.HelmError as e:
            print(f"render failed: {e}")
            sys.exit(2)
        docs = []
        for path in sorted(rendered):
            if path.endswith("NOTES.txt"):
                with open(out + ".NOTES.txt", "w") as f:
                    f.write(rendered[path])
                continue
            for doc in yaml.safe_load_all(rendered[path]):
                if doc:
                    docs.append(doc)
                    print(f"{path}: {doc['kind']}/{doc['metadata']['name']}")
        with open(out, "w") as f:
            yaml.safe_dump_all(docs, f, sort_keys=False)
    elif cmd == "lint":
        vals, namespace, kube_version = rest
        result = helm.lint(chart_dir, values(vals), strict=True, namespace=namespace, kube_version=kube_version)
        bad = False
        for m in result.get("messages", []):
            sev = SEVERITY.get(m.get("severity"), str(m.get("severity")))
            print(f"[{sev}] {m.get('path')}: {m.get('error')}".rstrip())
            # INFO (e.g. "icon is recommended": no icon is hosted) passes, as with `helm lint --strict`.
            bad |= m.get("severity", 0) >= 2
        bad |= bool(result.get("errors"))
        print(f"linted {result.get('total_charts_linted')} chart(s)")
        sys.exit(1 if bad else 0)
    elif cmd == "crds":
        (out,) = rest
        chart = helm.Chart.load(chart_dir)
        os.makedirs(out, exist_ok=True)
        for crd in chart.crds:
            with open(os.path.join(out, os.path.basename(crd["filename"])), "w") as f:
                f.write(crd["data"])
            print(crd["filename"])
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
