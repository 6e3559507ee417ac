"""The documentation stays true to the code.

* ``docs/config.md`` is what ``scripts/gen_docs.py`` generates from the pydantic config schema;
* the generator renders the types the schema uses (``Literal``, ``ByteSize``, durations, nested
  sections, arrays of tables);
* ``docs/events.md`` documents every event kind the code emits, with every keyword field;
* relative links in ``README.md`` and ``docs/`` point at files and headings that exist;
* the README's first commands and exit-code table match the scripts and ``ExitCode``;
* ``benchmarks/README.md`` has one short row per benchmark script.

Fast (no torch launch): it only imports the config schema and parses source files.
"""

from __future__ import annotations

import ast
import enum
import importlib.util
import re
from pathlib import Path
from typing import Annotated, Literal, Optional

import pytest
from pydantic import BaseModel, BeforeValidator, ByteSize, Field, field_validator

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SRC = ROOT / "src" / "trainguard"


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# config reference


def test_config_reference_is_current(capsys):
    code = _gen_docs().main(["--check"])
    err = capsys.readouterr().err
    assert code == 0, f"{err.strip()}"


def test_check_names_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text("# old\n")
    assert _gen_docs().main(["--check", "--output", str(stale)]) == 1
    assert str(stale) in capsys.readouterr().err
    assert _gen_docs().main(["--output", str(stale)]) == 0
    assert _gen_docs().main(["--check", "--output", str(stale)]) == 0


def test_generator_renders_the_schema_types():
    gen = _gen_docs()
    from trainguard.sections import parse_bytes, parse_duration

    class Color(enum.Enum):
        RED = "red"
        BLUE = "blue"

    class Inner(BaseModel):
        """``[demo.inner]``: an inner section."""

        a: int = Field(1, ge=1, description="a count")

    class Demo(BaseModel):
        """``[demo]``: a section with every kind of key."""

        mode: Literal["full", "size"] = Field("full", description="a choice")
        maybe: Optional[Literal["a", "b"]] = Field(None, description="an optional choice")
        pattern: str = Field("x", pattern="^(x|y)$", description="a choice by pattern")
        limit: ByteSize = Field(ByteSize(20 * 2**30), description="a size")
        rss: Optional[int] = Field(None, gt=0, description="a size parsed by a validator")
        wait: Annotated[float, BeforeValidator(parse_duration)] = Field(60.0, description="a duration")
        color: Color = Field(Color.RED, description="an enum")
        table: dict[str, float] = Field({}, description="a table")
        names: list[str] = Field(["SIGTERM"], description="a list")
        bare: int = 3
        inner: Inner = Inner()
        items: list[Inner] = Field([], description="an array of tables")

    class WithValidator(Demo):
        @field_validator("rss", mode="before")
        @classmethod
        def _bytes(cls, v):
            return parse_bytes(v)

    page = gen.Page()
    page.section(WithValidator, "demo", False, 2)
    text = "\n".join(page.lines)
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", text, re.M)}
    assert '"full" \\| "size"' in rows["mode"] and '`"full"`' in rows["mode"]
    assert '"a" \\| "b"' in rows["maybe"] and "unset" in rows["maybe"]
    assert '"x" \\| "y"' in rows["pattern"]
    assert "| size |" in rows["limit"] and "21474836480" in rows["limit"] and "20GiB" in rows["limit"]
    assert "| size, > 0 |" in rows["rss"]
    assert "| duration |" in rows["wait"]
    assert '"red" \\| "blue"' in rows["color"]
    assert "table of string → float" in rows["table"]
    assert '`["SIGTERM"]`' in rows["names"]
    assert "*(no description)*" in rows["bare"] and page.undocumented == ["demo.bare"]
    assert "### `[demo.inner]`" in text and "### `[[demo.items]]`" in text
    assert "| int, ≥ 1 | `1` | a count |" in text


# ---------------------------------------------------------------------------------------------
# event reference

EMITTERS = {"emit", "_emit0", "_emit"}


def emitted_events() -> dict[str, dict[str, set[str]]]:
    """``{kind: {field: {"file:line", ...}}}`` of every event emitted under src/trainguard: the
    calls of ``emit``/``_emit0``/``_emit`` with a literal kind and their keyword arguments."""
    found: dict[str, dict[str, set[str]]] = {}
    for path in sorted(SRC.rglob("*.py")):
        if SRC / "examples" in path.parents:  # the example GPT the wheel ships: a user's script, its own events
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name not in EMITTERS:
                continue
            kinds = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if not kinds:
                continue  # a wrapper passing its own `kind` on
            fields = found.setdefault(kinds[0], {})
            for kw in node.keywords:
                if kw.arg is not None:
                    fields.setdefault(kw.arg, set()).add(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def documented_events() -> dict[str, str]:
    """``{kind: the text of its section}`` from docs/events.md (headings ``### `kind` ``)."""
    text = (DOCS / "events.md").read_text()
    parts = re.split(r"^### `(\w+)`.*$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_every_emitted_event_is_documented():
    emitted, documented = emitted_events(), documented_events()
    assert len(emitted) > 30, "the source scan found too few events: has emit() been renamed?"
    missing = sorted(set(emitted) - set(documented))
    assert not missing, f"docs/events.md lacks these event kinds (add a '### `kind`' section each): {missing}"
    gaps = []
    for kind, fields in sorted(emitted.items()):
        body = documented[kind]
        for field, where in sorted(fields.items()):
            if not re.search(rf"`{re.escape(field)}`", body):
                gaps.append(f"{kind}.{field} (emitted at {', '.join(sorted(where))})")
    assert not gaps, (
        "docs/events.md does not mention these fields (as `field`) in their event's section:\n  " + "\n  ".join(gaps)
    )


def test_no_documented_event_is_gone():
    gone = sorted(set(documented_events()) - set(emitted_events()))
    assert not gone, f"docs/events.md documents event kinds that nothing emits any more: {gone}"


# ---------------------------------------------------------------------------------------------
# links, README


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.M):
        base = github_anchor(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue  # http:, https:, mailto:
        file_part, _, fragment = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target} (no heading #{fragment} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_readme_first_commands_exist():
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:25])
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh"):
        assert command in head, f"the README's first screen should show `{command}`"
        script = (ROOT / command.split()[1]).read_text()
        assert "scripts/setup.sh" in script, f"{command} must set up .venv first (scripts/setup.sh)"
    assert ".venv" in (ROOT / "scripts" / "setup.sh").read_text()


def test_readme_exit_codes_match_exitcode():
    from trainguard.exitcodes import ExitCode

    text = (ROOT / "README.md").read_text()
    rows = set(re.findall(r"^\| (\d+) \|", text, re.M))
    assert rows == {str(int(c)) for c in ExitCode}, (
        f"README exit-code table rows {sorted(rows)} != ExitCode {[int(c) for c in ExitCode]}"
    )


def test_design_md_has_the_membership_state_machines_current_table():
    """docs/design.md copies the rules table of trainguard/launcher/membership.py verbatim."""
    from trainguard.launcher import membership

    doc = membership.__doc__
    table = doc[doc.index("=====") : doc.index("\n", doc.rindex("====="))]
    assert table in (DOCS / "design.md").read_text(), "copy the table of launcher/membership.py into docs/design.md"


def test_benchmarks_readme_has_one_short_row_per_benchmark():
    """benchmarks/README.md: each benchmark script one table row of six short cells (script,
    measures, baseline, goal, last result, date); history lives in git, not in the table."""
    bench = ROOT / "benchmarks"
    scripts = sorted(p.name for p in bench.glob("*.py") if not p.name.startswith(("_", "test_")))
    rows = [line for line in (bench / "README.md").read_text().splitlines() if line.startswith("| `")]
    named = [re.match(r"\| `([^`]+)`", row).group(1) for row in rows]
    assert sorted(named) == scripts, f"one row per benchmark script: {sorted(named)} != {scripts}"
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert len(cells) == 6, f"script | measures | baseline | goal | last result | date: {row[:80]}"
        assert all(len(c) <= 120 for c in cells), f"a cell longer than 120 characters (history goes to git): {row[:80]}"
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}|—", cells[5]), f"the date of the last result, or —: {cells[5]!r}"


def test_the_patch_table_in_the_guard_docs_is_the_codes():
    """docs/guard.md's table of what trainguard writes into other packages is trainguard.patches'."""
    from trainguard import patches

    text = (ROOT / "docs" / "guard.md").read_text()
    start = text.index("<!-- patches:")
    table = text[text.index("\n", start) + 1 : text.index("<!-- /patches -->")]
    assert table == patches.markdown()


def test_the_loops_page_shows_the_example_verbatim():
    """docs/loops.md: every Python block is a part of examples/loops.py as it is (the page's loops
    are the ones tests/test_loops.py runs)."""
    source = (ROOT / "examples" / "loops.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "loops.md").read_text(), flags=re.S)
    assert len(blocks) == 4
    for block in blocks:
        for part in block.strip().split("\n\n\n"):
            assert part in source, part[:200]
