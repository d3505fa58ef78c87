#!/usr/bin/env bash
# The README's test command: sets up .venv (Python 3.11) with the test extra, lints, runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3.11 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[test]"
.venv/bin/ruff check qsgd_jax tests benchmarks examples
# One worker a core (pytest-xdist), each test file whole on one worker: the files that start
# real processes or network namespaces keep their own order. pytest exits 5 when it collected
# no tests: that is a failure here, as any non-zero code is. The checks marked slow run with
# scripts/test_slow.sh (a later -m, as that script passes, replaces this one).
.venv/bin/python -m pytest --numprocesses=auto --dist=loadfile -m "not slow" "$@"
