"""Validates manifests with real schemas; used by testkit/src/validate.rs.

  validate.py k8s VERSION FILE...   every document against Kubernetes VERSION (kubernetes-validate, strict)
  validate.py crd CRD FILE...       every document against the CRD's openAPIV3Schema (jsonschema)

Prints one line per document and exits 1 if any is rejected.
"""

import sys

import jsonschema
import kubernetes_validate
import yaml


def documents(paths):
    for path in paths:
        with open(path) as f:
            for i, doc in enumerate(yaml.safe_load_all(f)):
                if doc is not None:
                    yield f"{path}#{i} {doc.get('kind')}/{doc.get('metadata', {}).get('name')}", doc


def strip_k8s_extensions(schema):
    """OpenAPI v3 `nullable` and `x-kubernetes-*` keywords are not JSON Schema: keep the rest."""
    if isinstance(schema, dict):
        out = {}
        for k, v in schema.items():
            if k.startswith("x-kubernetes-") or k == "nullable":
                continue
            out[k] = strip_k8s_extensions(v)
        if schema.get("x-kubernetes-int-or-string"):
            out["type"] = ["integer", "string"]
        return out
    if isinstance(schema, list):
        return [strip_k8s_extensions(v) for v in schema]
    return schema


def main():
    mode, target, *paths = sys.argv[1:]
    failed = 0
    if mode == "crd":
        with open(target) as f:
            crd = yaml.safe_load(f)
        schema = strip_k8s_extensions(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
        validator = jsonschema.Draft7Validator(schema)
        for name, doc in documents(paths):
            errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]
            print(("ok   " if not errors else "FAIL ") + name + "".join("\n     " + e for e in errors))
            failed += bool(errors)
    elif mode == "k8s":
        for name, doc in documents(paths):
            try:
                kubernetes_validate.validate(doc, target, strict=True)
                print(f"ok   {name} (Kubernetes {target}, strict)")
            except kubernetes_validate.ValidationError as e:
                print(f"FAIL {name} (Kubernetes {target}): {e.path}: {e.message}")
                failed += 1
    else:
        sys.exit(f"unknown mode {mode}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
