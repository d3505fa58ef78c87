"""What the documentation promises that needs no build: every public name in the API reference
with an example that runs, the README's headline table what the results files say, and the guide
sections that new users copy whole running as written.

``bash scripts/docs.sh`` also executes every guide and checks every cross-reference (minutes: more
than the test suite's budget).
"""

import doctest
import importlib.util
import inspect
import pathlib
import re
import types

import pytest

import qsgd_jax

_ROOT = pathlib.Path(__file__).parent.parent
_CODE_CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_DIRECTIVE = re.compile(
    r"^\.\. (?:autofunction|autoclass|automodule|py:data)::\s+(?:qsgd_jax\.)?(\S+)", re.MULTILINE)


def _documented() -> set[str]:
  return {name for page in (_ROOT / "docs" / "api").glob("*.rst")
          for name in _DIRECTIVE.findall(page.read_text())}


def test_every_public_name_is_in_the_api_reference():
  missing = set(qsgd_jax.__all__) - _documented()
  assert not missing, f"add these to a page of docs/api/: {sorted(missing)}"


def _public_objects():
  """``(name, object)`` of every public name, a submodule's public names in its place."""
  for name in qsgd_jax.__all__:
    value = getattr(qsgd_jax, name)
    if isinstance(value, types.ModuleType):
      yield from ((f"{name}.{member}", getattr(value, member)) for member in value.__all__)
    elif callable(value):
      yield name, value


def test_every_public_name_has_an_example():
  def has_example(value) -> bool:
    doc = inspect.getdoc(value) or ""
    return ">>>" in doc or "Examples:" in doc  # The latter for what a doctest cannot run.

  without = [name for name, value in _public_objects() if not has_example(value)]
  # resize.Rule is a type alias (a Callable): there is nothing to call.
  assert without == ["resize.Rule"], f"give these an Examples: section: {without}"


def test_the_readme_table_is_what_the_results_files_say():
  spec = importlib.util.spec_from_file_location("figures", _ROOT / "benchmarks" / "figures.py")
  figures = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(figures)
  assert figures.main(["--check"]) == 0, "run python benchmarks/figures.py"


def _docstring_examples() -> list[doctest.DocTest]:
  """The ``>>>`` examples of every public name's docstring (a class's methods' too)."""
  finder, found = doctest.DocTestFinder(), {}
  for name, value in _public_objects():
    for test in finder.find(value, name, globs={}):
      if test.examples and test.name not in found:
        found[test.name] = test
  return sorted(found.values(), key=lambda test: test.name)


# Slow: each compiles its own programs, and scripts/docs.sh runs them too (sphinx's doctest).
@pytest.mark.slow
@pytest.mark.parametrize("test", _docstring_examples(), ids=lambda test: test.name)
def test_docstring_example_runs(test):
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  output = []
  result = runner.run(test, out=output.append)
  assert result.failed == 0, "".join(output)


def _section_cells(guide: str, heading: str) -> list[tuple[str, str]]:
  """``(name, source)`` of the code cells of ``docs/guides/<guide>``'s ``## <heading>`` section."""
  text = (_ROOT / "docs" / "guides" / guide).read_text()
  start = text.index(f"\n## {heading}\n")
  end = text.find("\n## ", start + 1)
  section = text[start:] if end < 0 else text[start:end]
  return [(f"{guide}, {heading}, cell {i}", source)
          for i, source in enumerate(_CODE_CELL.findall(section))]


def _run_cells(cells: list[tuple[str, str]]) -> dict:
  """Runs the cells in order in one namespace, as the notebook kernel does."""
  namespace = {"__name__": "__guide__"}
  for name, source in cells:
    exec(compile(source, name, "exec"), namespace)  # noqa: S102 - the guide's own code.
  return namespace


# Sections that import what they use, so that they run alone.
@pytest.mark.slow
@pytest.mark.parametrize("guide, heading", [
    ("training_loops.md", "Dropout: a key a step and a device"),
    # Its last cell asserts that the two steps give the same bits.
    ("two_level.md", "DiLoCo across the nodes"),
])
def test_guide_section_runs_as_written(guide, heading):
  cells = _section_cells(guide, heading)
  assert cells, f"no code cell under ## {heading} in {guide}"
  namespace = _run_cells(cells)
  assert "loss" in namespace
