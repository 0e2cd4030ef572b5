"""Reads the pages, finds their claim sentences, checks each ledger entry against the page and the test source,
and renders docs/claims.md."""

from __future__ import annotations

import ast
import importlib
import math
import re
import textwrap
from pathlib import Path

from tests.claims.kinds import Benchmark, Claim, NotAClaim

REPO = Path(__file__).resolve().parents[2]
GENERATED = ("configuration.md", "claims.md")  # written by tools, not by hand
PAGE = REPO / "docs" / "claims.md"
CLAIM_WORDS = re.compile(
    r"\bwithin\b|bit-identical|bit for bit|bitwise|byte for byte|to the byte|\bidentical\b|\bequal(s|led)?\b|\d%"
    r"|\bof a step\b|\b\d+(?:\.\d+)?x\b",  # a share of a step's time, a ratio ("2.8x", "0.97x")
    re.I,
)
MAX_RATIO = 10  # a bound at most ~10x the figure quoted, or the page says what the test holds
# A figure a sentence states: a decimal, a power of ten, a percentage or a ratio (code spans aside). Each one in a claim
# sentence is in the words of some entry for it: one entry per claim, not one per sentence.
FIGURE = re.compile(
    r"(?<![\w.=/-])(\d+(?:\.\d+)?%|\d+(?:\.\d+)?x(?!\w)|\d+(?:\.\d+)?e-?\d+(?!\w|\.\d)|\d+\.\d+(?!\w|\.\d))"
)


def pages() -> list[Path]:
    docs = sorted(p for p in (REPO / "docs").glob("*.md") if p.name not in GENERATED)
    return [REPO / "README.md", *docs]


def one_line(text: str) -> str:
    return " ".join(text.split())


def units(text: str) -> list[str]:
    """The page's sentences (and table-cell clauses) that use a claim word; code blocks and command cells aside."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    paras, cur = [], []
    for line in text.splitlines():
        starts_item = line.lstrip().startswith(("- ", "* ", "#")) or re.match(r"\s*\d+\. ", line)
        if line.startswith("|") or not line.strip() or starts_item:
            if cur:
                paras.append(" ".join(cur))
            cur = [line.strip()] if starts_item else []
            if line.startswith("|"):
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if not all(set(c) <= set("-: ") for c in cells):
                    paras += [c for c in cells if not (c.startswith("`") and c.endswith("`"))]
        else:
            cur.append(line.strip())
    if cur:
        paras.append(" ".join(cur))
    sentences = (s for p in paras for s in re.split(r"(?<=[.;])\s+(?=[A-Za-z(`*])", one_line(p)))
    return [s for s in sentences if CLAIM_WORDS.search(s)]


def figures(text: str) -> set[str]:
    """The figures (`FIGURE`) of `text` outside its code spans."""
    return set(FIGURE.findall(re.sub(r"`[^`]*`", "", text)))


def entries(page: Path) -> tuple:
    name = "readme" if page.name == "README.md" else page.stem
    try:
        return importlib.import_module(f"tests.claims.{name}").CLAIMS
    except ModuleNotFoundError:
        return ()


def source_of(test: str) -> str | None:
    """The text of `path` or of `path::name` (a function, class or module-level assignment in it)."""
    path, _, name = test.partition("::")
    file = REPO / path
    if not file.is_file():
        return None
    text = file.read_text()
    if not name:
        return text
    for node in ast.walk(ast.parse(text)):
        named = getattr(node, "name", None) == name or (
            isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets)
        )
        if named:
            return ast.get_source_segment(text, node)
    return None


NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?(?:e-?\d+)?)(?!\w)")
TEST_LEARNING_RATE = 3e-3  # the training tests' learning_rate (tests/test_training.py): bounds "of lr" scale by it


def bound_is_in_test(entry: Claim) -> bool:
    """Whether `entry.bound` is read from its test rather than typed beside it: a number of the test's source (the
    function, or the module-level table, named by `entry.test`, and the module-level tables that function reads),
    as it stands, times the learning rate where the source scales by it, or times a factor the file applies to the
    table (`10 * MEASURED_WEIGHT_DIFF[layout]`)."""
    path, _, name = entry.test.partition("::")
    text = (REPO / path).read_text()
    source = source_of(entry.test) or ""
    read = {n.id for n in ast.walk(ast.parse(textwrap.dedent(source))) if isinstance(n, ast.Name)} | {name}
    for node in ast.parse(text).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and any(getattr(t, "id", None) in read for t in targets):
            source += " " + ast.get_source_segment(text, node)
    numbers = {float(x) for x in NUMBER.findall(f"{source} {entry.holds}")}
    scales = {1.0} | ({TEST_LEARNING_RATE} if "learning_rate" in f"{source} {entry.holds}" else set())
    scales |= {float(m[1]) for m in re.finditer(rf"(\d+(?:\.\d+)?) \* {re.escape(name)}\b", text)}
    scales |= {float(m[1]) for m in re.finditer(r"\b(\d+(?:\.\d+)?) \* [A-Z_]+\[", source)}
    return any(math.isclose(entry.bound, n * s, rel_tol=1e-6) for n in numbers for s in scales)


def check_entry(name: str, text: str, found: list[str], entry) -> list[str]:
    where = f"{name}: {entry.says[:60]!r}"
    if one_line(entry.says) not in text:
        return [f"{where}: not on the page"]
    if isinstance(entry, Benchmark):
        return [] if (REPO / entry.by.split()[0]).exists() else [f"{where}: no benchmark {entry.by}"]
    if isinstance(entry, NotAClaim):
        return []
    if entry.test.startswith("benchmarks/"):  # no test runs it: a Benchmark entry says so
        return [f"{where}: {entry.test} is a benchmark, not a test (a Benchmark entry, or hold it in a test)"]
    source = source_of(entry.test)
    if source is None:
        return [f"{where}: no {entry.test}"]
    if one_line(entry.holds) not in one_line(source):
        return [f"{where}: {entry.holds!r} is not in {entry.test}"]
    if entry.bound and not bound_is_in_test(entry):
        return [f"{where}: bound {entry.bound:g} is no number of {entry.test} (typed beside it, not read from it)"]
    if entry.bound and entry.figure:
        if entry.figure > entry.bound:
            return [f"{where}: the figure {entry.figure:g} is outside its bound {entry.bound:g}"]
        said = [u for u in found if one_line(entry.says) in u or u in one_line(entry.says)]
        plain = any(re.search(r"\bheld (at|to)\b|\bholds\b", u) for u in said)
        if entry.bound > MAX_RATIO * entry.figure and not plain:
            return [f"{where}: bound {entry.bound:g} is {entry.bound / entry.figure:.0f}x the figure {entry.figure:g}"]
    return []


def page_problems(name: str, raw: str, ledger: tuple) -> list[str]:
    """What is wrong with one page (`name`, its text `raw`) and its ledger entries: entries that fail
    `check_entry`, claim sentences without an entry, and figures of a claim sentence that no entry for it states."""
    text, found = one_line(raw), units(raw)
    out = [problem for entry in ledger for problem in check_entry(name, text, found, entry)]
    says = [one_line(e.says) for e in ledger]
    for unit in found:
        matched = [s for s in says if s in unit or unit in s]
        if not matched:
            out.append(f"{name}: no entry for {unit!r}")
            continue
        missing = figures(unit) - set().union(*(figures(s) for s in matched))
        if missing:
            out.append(f"{name}: {', '.join(sorted(missing))} of {unit[:90]!r} in no entry (one entry per claim)")
    return out


def problems() -> list[str]:
    return [problem for page in pages() for problem in page_problems(page.name, page.read_text(), entries(page))]


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    lines = [
        "# Claims and the tests that hold them",
        "",
        "Generated by `python -m tests.claims` from the ledger in `tests/claims/` (one module per page);",
        "`tests/test_claims.py` fails when a claim of README.md or docs/ has no entry, when a figure of a claim",
        "sentence is in no entry (one entry per claim), when an entry's words left its page, its assertion left its",
        "test, its bound is no number of its test's source or more than 10x the figure quoted without the page saying",
        "what the test holds, or it names a benchmark as its test. Bound 0 is equality; a figure measured by a benchmark is reported, not asserted.",
    ]
    for page in pages():
        ledger = entries(page)
        if not ledger:
            continue
        lines += ["", f"## {page.relative_to(REPO)}", "", "| claim | held by | bound | measured |", "|---|---|---|---|"]
        for e in ledger:
            if isinstance(e, Claim):
                bound = "" if e.bound is None else ("equal" if e.bound == 0 else f"{e.bound:g}")
                figure = "" if e.figure is None else f"{e.figure:g}"
                lines.append(f"| {cell(e.says)} | `{e.test}`: `{cell(one_line(e.holds))}` | {bound} | {figure} |")
            elif isinstance(e, Benchmark):
                lines.append(f"| {cell(e.says)} | benchmark `{e.by}` (reported, not asserted) | | |")
            else:
                lines.append(f"| {cell(e.says)} | not a claim: {cell(e.why)} | | |")
    return "\n".join(lines) + "\n"
