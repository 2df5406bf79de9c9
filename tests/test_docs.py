"""The documents a newcomer reads: the README stays one page, every relative link lands on a
file (and a heading, where it names one), the module map of docs/architecture.md names exactly
the modules of ``embcache/``, and the README's examples run."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAP = ROOT / "docs" / "architecture.md"
MAX_README_LINES = 180

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
MODULE = re.compile(r"`(embcache/[\w/]+\.py)`")


def linked_documents() -> list[Path]:
    """The documents whose links are checked: the README, CONTRIBUTING, docs/, the design and
    the TLA+ README."""
    return [
        README,
        ROOT / "CONTRIBUTING.md",
        ROOT / "embcache" / "DESIGN.md",
        ROOT / "tla" / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
    ]


def prose(text: str) -> str:
    """``text`` without fenced blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def relative_links(path: Path) -> list[str]:
    """Every link target of ``path`` that is neither a URL nor a mail address."""
    targets = LINK.findall(prose(path.read_text()))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``path``: lower case, punctuation dropped,
    spaces as hyphens, a repeated one suffixed ``-1``, ``-2``, ..."""
    seen: Counter[str] = Counter()
    result = set()
    for title in HEADING.findall(FENCE.sub("", path.read_text())):
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").strip().lower()).replace(" ", "-")
        result.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return result


def broken_links(path: Path) -> list[str]:
    """The relative links of ``path`` that name no file, or no heading of the file they name."""
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return broken


def test_the_readme_is_one_page() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (at most {MAX_README_LINES}): move detail to docs/"
    )


@pytest.mark.parametrize("path", linked_documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert relative_links(path) or path.parent.name != "docs", f"{path.name} links nowhere"
    assert broken_links(path) == [], f"broken links in {path.relative_to(ROOT)}"


def test_a_broken_link_and_a_broken_anchor_are_caught(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Some `code` here: yes\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#some-code-here-yes) [web](https://example.com)\n"
        "`[not a link](nowhere.md)`\n\n```\n[nor this](nowhere.md)\n```\n"
        "[gone](missing.md) [bad anchor](other.md#nothing)\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#nothing: no heading with anchor #nothing in other.md",
    ]


def test_the_module_map_names_every_module_and_only_modules_that_exist() -> None:
    named = set(MODULE.findall(MAP.read_text()))
    present = {p.relative_to(ROOT).as_posix() for p in (ROOT / "embcache").rglob("*.py")}
    assert named - present == set(), "docs/architecture.md names modules that do not exist"
    assert present - named == set(), "modules missing from docs/architecture.md's map"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), re.M | re.S)


def test_the_readme_examples_run() -> None:
    """Each Python example of the README, with the two names it leaves to the reader: a batch
    of images and an encoder giving one output of the item's shape and dtype per image."""
    blocks = python_blocks(README)
    assert len(blocks) == 2, "the README shows a request and the pipeline"
    images = torch.randint(0, 256, (1, 3, 28, 28), dtype=torch.uint8)
    for block, batch in zip(blocks, (images, list(images)), strict=True):
        names = {
            "images": batch,  # a tensor to mask, then a list as EncodePipeline takes it
            "encoder": lambda batch: torch.randn(len(batch), 576, 3584).to(torch.bfloat16),
        }
        exec(compile(block, "<README.md example>", "exec"), names)
    assert names["embeddings"].shape[0] == 1, "the pipeline's one image, one token"


def test_the_api_and_pipeline_pages_show_the_readme_examples() -> None:
    """docs/api.md and docs/pipeline.md open with the README's examples, so one test runs all."""
    request, pipeline = python_blocks(README)
    assert request in python_blocks(ROOT / "docs" / "api.md")
    assert pipeline in python_blocks(ROOT / "docs" / "pipeline.md")
