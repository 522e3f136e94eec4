"""Every Python snippet in the README and in docs/ runs (on CPU: the reference path, and eight
host devices for the multi-device ones), so what a user copies works."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def snippets():
    for page in PAGES:
        blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
        for index, code in enumerate(blocks):
            yield pytest.param(code, id=f"{page.relative_to(ROOT)}#{index}")


def test_the_pages_have_snippets():
    assert len(list(snippets())) >= 8


@pytest.mark.parametrize("code", list(snippets()))
def test_snippet_runs(code):
    exec(compile(code, "<snippet>", "exec"), {"__name__": "snippet"})  # noqa: S102
