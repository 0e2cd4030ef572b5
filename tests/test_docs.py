"""The docs stay true to the code: a short README, one page per topic, links that resolve, and the configuration
reference generated from the config dataclasses (every key, its default and one line)."""

from __future__ import annotations

import re

from tests.conftest import REPO

PAGES = (
    "converting",
    "training",
    "parallelism",
    "lora_and_preference",
    "checkpoints",
    "reliability_and_security",
    "architecture",
    "families",
    "moe",
    "measured",
    "configuration",
    "claims",
)


def markdown_files():
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_readme_is_short_and_links_every_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert {p.stem for p in (REPO / "docs").glob("*.md")} == set(PAGES)  # a new page is listed, so linked
    for page in PAGES:
        assert (REPO / "docs" / f"{page}.md").exists(), page
        assert f"(docs/{page}.md)" in readme, page


def test_every_link_resolves():
    broken = []
    for md in markdown_files():
        text = md.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (md.parent / path).resolve() if path else md
            if not file.exists():
                broken.append(f"{md.name}: {target}")
            elif anchor and file.suffix == ".md":
                headings = {slug(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)}
                if anchor not in headings:
                    broken.append(f"{md.name}: {target} (no such heading)")
    assert not broken, broken


def test_configuration_reference_is_generated_from_the_dataclasses():
    from schema.train import TrainConfig
    from tools.config_reference import PAGE, render, rows

    assert open(PAGE).read() == render(), "docs/configuration.md is stale: run python -m tools.config_reference"
    undescribed = [key for key, _, what in rows(TrainConfig) if not what]
    assert not undescribed, f"config keys without a comment on their field: {undescribed}"
    page = open(PAGE).read()
    for key, _, _ in rows(TrainConfig):
        assert f"| `{key}` |" in page, key
