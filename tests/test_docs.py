"""The README's first screen and the pages under docs/ it sends readers to.

The README is short: what dpkfac is, the two commands (`make train`, `make
test`, the first commands on the page, which CI runs), a minimal example, the
generated headline results (tests/test_benchmark_tables.py checks that block)
and links to docs/usage.md, docs/integrations.md, docs/experiments.md and
docs/reproduction.md, which hold the rest. Links between them must resolve.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = ("usage.md", "integrations.md", "experiments.md", "reproduction.md")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _fenced_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.S | re.M)


def test_the_readme_opens_with_the_two_commands() -> None:
    first = _fenced_blocks(README.read_text())[0].splitlines()
    assert [line.split("#")[0].strip() for line in first] == ["make train", "make test"]


def test_the_readme_is_one_screen_and_links_every_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 80
    for page in (*PAGES, "design.md"):
        assert f"](docs/{page})" in text, page
    for page in PAGES:
        assert (ROOT / "docs" / page).read_text().startswith("# ")


def test_the_readme_example_passes_options_by_keyword() -> None:
    """The constructor takes the model, then keyword arguments only."""
    (call,) = re.findall(r"KFACPreconditioner\(([^)]*)\)", README.read_text())
    model, *options = (part.strip() for part in call.split(","))
    assert model == "model" and options
    assert all(re.fullmatch(r"\w+=.+", option) for option in options), options


@pytest.mark.parametrize("path", ["README.md", *(f"docs/{page}" for page in PAGES)])
def test_relative_links_resolve(path: str) -> None:
    source = ROOT / path
    for target in LINK.findall(source.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        assert (source.parent / target.split("#")[0]).exists(), f"{path}: {target}"
