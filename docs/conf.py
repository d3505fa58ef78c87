"""Sphinx configuration of qsgd_jax's documentation: ``bash scripts/docs.sh`` builds it."""

import json
import os
import pathlib
import sys

_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))  # This checkout's qsgd_jax and examples, not an installed copy.

# The guides and the docstrings' examples run on 8 devices, as they would on a host with 8
# accelerators; without accelerators XLA simulates them on the CPU. The notebook kernels and the
# doctest builder inherit these variables, and JAX reads them when it starts.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

# The guides' kernel: this interpreter (whatever "python3" kernels are installed elsewhere), its
# own start-up log quiet (ipykernel warns that a local kernel talks over unencrypted TCP). Code
# that writes to stderr still fails the build (nb_output_stderr below).
_KERNELS = _ROOT / "docs" / "_build" / "jupyter"
(_KERNELS / "kernels" / "python3").mkdir(parents=True, exist_ok=True)
(_KERNELS / "kernels" / "python3" / "kernel.json").write_text(json.dumps({
    "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
             "--IPKernelApp.log_level=ERROR"],
    "display_name": "Python 3", "language": "python"}))
os.environ["JUPYTER_PATH"] = os.pathsep.join(
    [str(_KERNELS), *filter(None, [os.environ.get("JUPYTER_PATH")])])

import qsgd_jax  # noqa: E402

project = "qsgd_jax"
author = "The qsgd_jax authors"
copyright = "2025, the qsgd_jax authors"  # noqa: A001
version = release = qsgd_jax.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.doctest",
    "sphinx.ext.intersphinx",
    "sphinx.ext.mathjax",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
    "sphinx_design",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb"}
exclude_patterns = ["_build", "inventories", "**.ipynb_checkpoints", "README.md"]
root_doc = "index"

# Every reference must resolve: a broken one is a warning, and the build turns warnings into errors.
nitpicky = True

# API reference from the docstrings (Google style).
autodoc_default_options = {"member-order": "bysource"}
# Types are stated in the docstrings (shapes, dtypes); the annotations, expanded, would list
# every member of unions such as optax.OptState.
autodoc_typehints = "none"
autodoc_preserve_defaults = True
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = False
add_module_names = False

# The docstrings' ``>>>`` examples run with ``sphinx-build -b doctest``.
doctest_global_setup = ""
doctest_test_doctest_blocks = "default"

# JAX, optax, Flax and Python by their published pages. This machine has no network, so each
# inventory is a small one written by inventories/make.py with the real addresses of the pages
# these docs name; see that file.
intersphinx_mapping = {
    name: (url, str(pathlib.Path(__file__).parent / "inventories" / f"{name}.inv"))
    for name, url in {
        "python": "https://docs.python.org/3/",
        "numpy": "https://numpy.org/doc/stable/",
        "jax": "https://docs.jax.dev/en/latest/",
        "optax": "https://optax.readthedocs.io/en/latest/",
        "flax": "https://flax.readthedocs.io/en/latest/",
    }.items()
}

# Guides are MyST notebooks, executed as the site builds: a guide whose code raises, or writes to
# stderr (a warning a reader would see), fails the build.
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = "cache"
nb_execution_cache_path = str(_ROOT / "docs" / "_build" / ".jupyter_cache")
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_output_stderr = "warn"
nb_merge_streams = True

html_theme = "sphinx_book_theme"
html_title = "qsgd_jax"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
html_show_sourcelink = False
