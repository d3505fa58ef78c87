#!/usr/bin/env bash
# The README's main command: sets up .venv (Python 3.11) with the examples extra, then trains the
# digits example once per compression mode on 8 simulated CPU devices and writes a table and a plot.
# Arguments after the workdir go to examples.imagenet.compare, e.g. --seeds=0,1,2.
set -euo pipefail
cd "$(dirname "$0")/.."
python3.11 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[examples]"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
.venv/bin/python -m examples.imagenet.compare --workdir="${1:-runs/compare}" "${@:2}"
