"""mkdocs hook: serve the benchmark plots, which live outside ``docs/``.

The pages link the plots where the benchmarks write them
(``../benchmarks/results/*.png``, and ``results/<benchmark>/*.png`` for the
standalone scripts), so the links work on a repository browser too. The site gets a
copy of each plot under ``assets/benchmarks/`` (same relative path) and the links
point there; a link to a plot that does not exist is left alone, so mkdocs still
reports it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
TARGET = "assets/benchmarks"
LINK = re.compile(r"\]\((?P<path>[^)\s#]+\.png)\)")


def on_files(files: Files, config: Any) -> Files:
    for plot in sorted(RESULTS.rglob("*.png")):
        name = plot.relative_to(RESULTS).as_posix()
        files.append(File.generated(config, f"{TARGET}/{name}", abs_src_path=str(plot)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    page_dir = (Path(config["docs_dir"]) / page.file.src_uri).parent

    def relink(match: re.Match[str]) -> str:
        target = (page_dir / match.group("path")).resolve()
        if RESULTS not in target.parents or not target.exists():
            return match.group(0)
        up = posixpath.relpath(TARGET, posixpath.dirname(page.file.src_uri) or ".")
        return f"]({up}/{target.relative_to(RESULTS).as_posix()})"

    return LINK.sub(relink, markdown)
