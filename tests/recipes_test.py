"""Runs every ```python block of docs/recipes.md, each as a program of its own."""

import pathlib
import re

import pytest

_RECIPES = pathlib.Path(__file__).parent.parent / "docs" / "recipes.md"


def _python_blocks() -> list[tuple[str, str]]:
  """``(section title, code)`` of each python block, in the order of the file.

  The code is preceded by as many empty lines as the file has before it, so
  that a traceback names the line of recipes.md.
  """
  text = _RECIPES.read_text()
  blocks, section = [], "preamble"
  for match in re.finditer(r"^## ([^\n]+)$|^```python\n(.*?)^```$", text,
                           flags=re.MULTILINE | re.DOTALL):
    if match.group(1) is not None:
      section = match.group(1)
    else:
      blocks.append((section, "\n" * text.count("\n", 0, match.start(2)) + match.group(2)))
  return blocks


_BLOCKS = _python_blocks()


def test_every_recipe_has_a_program():
  sections = re.findall(r"^## (.+)$", _RECIPES.read_text(), flags=re.MULTILINE)
  assert sections == [section for section, _ in _BLOCKS]


@pytest.mark.parametrize("code", [code for _, code in _BLOCKS],
                         ids=[section for section, _ in _BLOCKS])
def test_recipe_runs(code):
  exec(compile(code, str(_RECIPES), "exec"), {"__name__": "__main__"})
