"""The Python examples in the docs run, so the docs cannot rot.

Convention for every ``docs/*.md`` page and ``README.md``:

- a fenced block opened with exactly ```` ```python ```` is executed;
- ```` ```{.python .no-run} ```` is shown (highlighted as Python) but not run: use it
  for examples that need a GPU, the network or minutes of compute. The site's fence
  parser (pymdownx.superfences) takes a bare language or the ``{...}`` form only: an
  opening line such as ```` ```python no-run ```` is not a fence to it, so the block
  and everything up to the next fence renders as text (a heading inside vanishes);
  ``test_fences_are_ones_the_site_parses`` refuses such lines;
- blocks of other languages (```` ```bash ````, ```` ```text ````, ...) are ignored.

The runnable blocks of one page execute in order in one shared namespace, like a
notebook, so a later block may use names from an earlier one. A failing block is
reported with its page and line number.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number, code)`` of every block opened with exactly ```` ```python ````."""
    blocks = []
    for match in FENCE.finditer(text):
        if match.group("info").strip() == "python":
            line = text.count("\n", 0, match.start("body")) + 1
            blocks.append((line, match.group("body")))
    return blocks


def test_block_extraction_follows_the_convention():
    text = (
        "intro\n```python\na = 1\n```\n"
        "```{.python .no-run}\nraise SystemExit\n```\n"
        "```bash\nexit 1\n```\n"
        "```python\nb = a + 1\n```\n"
    )
    assert runnable_blocks(text) == [(3, "a = 1\n"), (12, "b = a + 1\n")]


# what pymdownx.superfences accepts after the backticks: nothing, a language, a language
# with key="value" options, or a {...} attribute block
SITE_FENCE_INFO = re.compile(r'(?:[\w#.+-]+(?:\s+\w+="[^"]*")*|\{[^}]*\})?')


def fence_lines_the_site_cannot_parse(text: str) -> list[int]:
    return [
        number
        for number, line in enumerate(text.splitlines(), 1)
        if line.startswith("```") and not SITE_FENCE_INFO.fullmatch(line[3:].strip())
    ]


def test_fence_check_follows_the_site_parser():
    text = "```python\n```\n```{.python .no-run}\n```\n```python no-run\n```\n```\n"
    assert fence_lines_the_site_cannot_parse(text) == [5]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_fences_are_ones_the_site_parses(page: Path) -> None:
    assert fence_lines_the_site_cannot_parse(page.read_text()) == [], page.name


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_examples_run(page: Path) -> None:
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for line, code in runnable_blocks(page.read_text()):
        # pad with blank lines so tracebacks give the line number in the page itself
        compiled = compile("\n" * (line - 1) + code, str(page.relative_to(ROOT)), "exec")
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                exec(compiled, namespace)
            except Exception as error:
                raise AssertionError(
                    f"the python block at {page.relative_to(ROOT)} line {line} fails: "
                    f"{type(error).__name__}: {error}"
                ) from error
