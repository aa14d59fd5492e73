#!/usr/bin/env bash
# Structured outputs (issue 38): one ferrite-server, bench-serve at CONCURRENCY (default 8)
# with every request free (the baseline) against every request constrained by the JSON schema
# in bench/schemas/people.json (objects with strings, an enum, an integer range and an email
# pattern, at least 100 of them, so every request generates its whole max_tokens in both arms),
# REPEAT times (default 2) alternating which goes first; ratios are constrained ÷ free.
# TEMPERATURE (default 1, OpenAI's default) is both arms' sampling temperature; ROUNDS
# (default 2) is bench-serve's --rounds.
#
#   bench/structured.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"
port=18191 log=/tmp/bench-structured-server.log
serve "$port" "$log" --no-enable-prefix-caching
pid=${pids[-1]}
wait_health "$port"
url=http://127.0.0.1:$port
"$target"/release/bench-serve --target "free=$url" --target "json=$url" \
  --target-body "json=$(dirname "$0")/schemas/people.json" --model default \
  --temperature "${TEMPERATURE:-1}" \
  --concurrency "${CONCURRENCY:-8}" --repeat "${REPEAT:-2}" --rounds "${ROUNDS:-2}" \
  --pid "free=$pid" --pid "json=$pid"
