#!/usr/bin/env bash
# The slow checks (marked slow: benchmark scripts at their smallest sizes, long example runs,
# real processes, every docstring example):
# the README's test command's set-up, lint and runner, these tests instead of the others.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/test.sh -m slow "$@"
