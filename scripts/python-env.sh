#!/usr/bin/env bash
# Creates .venv with the Python packages the tests drive the server with (the official openai
# client, httpx, pytest). Prints the venv's python. Idempotent.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.venv"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import openai, httpx, pytest' 2>/dev/null; then
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check \
    'openai>=1.50,<3' 'httpx>=0.27' 'pytest>=8' >&2
fi
echo "$venv/bin/python"
