#!/usr/bin/env bash
# The documentation site: sets up .venv (Python 3.11) with the docs extra, checks that the README's
# headline table is what benchmarks/results says, runs every docstring example (Sphinx's doctest
# builder), and builds the site with every guide executed (MyST-NB), warnings as errors, into
# docs/_build/html. Offline: the inventories of JAX, optax and Flax come from docs/inventories/.
set -euo pipefail
cd "$(dirname "$0")/.."
python3.11 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[docs]"
.venv/bin/python benchmarks/figures.py --check
build() {
  .venv/bin/sphinx-build -W --keep-going -q -b "$1" -d docs/_build/doctrees docs "docs/_build/$1"
}
build doctest
build html
echo "The site: docs/_build/html/index.html"
