#!/usr/bin/env python3
"""Generate ``docs/config.md``, the config reference, from the pydantic schema.

The reference is built from ``trainguard.config.Config`` (every section, nested sections such as
``[checkpoint.local]`` and arrays of tables such as ``[[faults.inject]]``) and from the settings of
``trainguard watch`` (``trainguard.watch.config.WatchSection``): for each key its type and
constraints, its default and its ``Field(description=...)``; for each section the class docstring.

Usage::

    .venv/bin/python scripts/gen_docs.py           # write docs/config.md
    .venv/bin/python scripts/gen_docs.py --check   # exit 1, naming the file, when it is stale

A key without a description is rendered as "*(no description)*" and listed on stderr.
"""

from __future__ import annotations

import argparse
import enum
import inspect
import json
import re
import sys
import types
import typing
from pathlib import Path, PurePath
from typing import Any, Literal, Optional, Union

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "docs" / "config.md"

try:
    from pydantic import BaseModel, ByteSize
    from pydantic.fields import FieldInfo
except ImportError:  # pragma: no cover
    sys.exit(
        "gen_docs.py: pydantic is not installed; run it with .venv/bin/python (bash scripts/setup.sh creates .venv)"
    )

NoneType = type(None)
_UNIONS = {Union, types.UnionType}
_SIMPLE = {bool: "bool", int: "int", float: "float", str: "string", bytes: "bytes", Any: "any"}
_ALTERNATION = re.compile(r"^\^\(?([\w.-]+(?:\|[\w.-]+)*)\)?\$$")  # ^(a|b|c)$: a closed set of words


# ---------------------------------------------------------------------------------------------
# what kind of value a key takes


def _validator_funcs(model: type[BaseModel], name: str, field: FieldInfo) -> list[Any]:
    """Functions that validate ``name`` besides its type: ``@field_validator``s naming it and
    validators inside ``Annotated[...]`` metadata (``BeforeValidator(parse_bytes)``, ...)."""
    funcs = []
    decorators = getattr(model, "__pydantic_decorators__", None)
    for dec in decorators.field_validators.values() if decorators else ():
        fields = dec.info.fields
        if name in fields or "*" in fields:
            funcs.append(getattr(dec.func, "__func__", dec.func))
    for meta in field.metadata:
        if callable(getattr(meta, "func", None)):
            funcs.append(meta.func)
    return funcs


def _parses(funcs: list[Any], parser: str) -> bool:
    """Whether any of ``funcs`` is, or calls, the function named ``parser`` (``parse_bytes``, ...)."""
    for f in funcs:
        f = inspect.unwrap(f)
        code = getattr(f, "__code__", None)
        names = (*getattr(code, "co_names", ()), *getattr(code, "co_freevars", ()))
        if getattr(f, "__name__", "") == parser or parser in names:
            return True
    return False


def value_kind(model: type[BaseModel], name: str, field: FieldInfo) -> Optional[str]:
    """``"size"`` for byte sizes (``ByteSize``, or a validator using ``parse_bytes``), ``"duration"``
    for durations (a validator using ``parse_duration``), else ``None``."""
    if any(t is ByteSize for t in _leaves(field.annotation)):
        return "size"
    funcs = _validator_funcs(model, name, field)
    if _parses(funcs, "parse_bytes"):
        return "size"
    if _parses(funcs, "parse_duration"):
        return "duration"
    return None


def _leaves(annotation: Any) -> list[Any]:
    """The member types of a union, ``Annotated`` and ``Optional`` unwrapped."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _leaves(typing.get_args(annotation)[0])
    if origin in _UNIONS:
        return [leaf for arg in typing.get_args(annotation) for leaf in _leaves(arg)]
    return [annotation]


def _model_in(annotation: Any) -> Optional[tuple[str, type[BaseModel]]]:
    """``("table", M)`` for a nested model ``M`` (or ``Optional[M]``), ``("array", M)`` for
    ``list[M]``; else ``None``."""
    for leaf in _leaves(annotation):
        if isinstance(leaf, type) and issubclass(leaf, BaseModel):
            return "table", leaf
        if typing.get_origin(leaf) in (list, tuple, typing.Sequence):
            args = [a for a in typing.get_args(leaf) if a is not Ellipsis]
            if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
                return "array", args[0]
    return None


# ---------------------------------------------------------------------------------------------
# rendering types, constraints, defaults


def toml_value(value: Any) -> str:
    """``value`` written as a TOML value (strings quoted, booleans lower case, tables inline)."""
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if not isinstance(value, int) else str(int(value))
    if isinstance(value, (str, PurePath)):
        return json.dumps(str(value), ensure_ascii=False)
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}" if value else "{}"
    if isinstance(value, (list, tuple, set, frozenset)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return str(value)


def type_text(annotation: Any) -> str:
    """A reader's name for a type: ``int``, ``"a" | "b"``, ``list of string``, ``table of string → float``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin in _UNIONS:
        parts = [type_text(a) for a in args if a is not NoneType]
        return " or ".join(dict.fromkeys(parts))
    if origin is Literal:
        return " | ".join(toml_value(a) for a in args)
    if annotation is ByteSize:
        return "size"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(toml_value(m.value) for m in annotation)
    if isinstance(annotation, type) and issubclass(annotation, PurePath):
        return "path"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    if origin in (list, tuple, set, frozenset, typing.Sequence) or annotation in (list, tuple, set):
        items = [a for a in args if a is not Ellipsis]
        return "list of " + (type_text(items[0]) if len(items) == 1 else "values")
    if origin in (dict, typing.Mapping) or annotation is dict:
        return f"table of {type_text(args[0])} → {type_text(args[1])}" if len(args) == 2 else "table"
    for t, name in _SIMPLE.items():
        if annotation is t:
            return name
    if isinstance(annotation, type):
        for t, name in _SIMPLE.items():  # subclasses of int, str, ... (ByteSize was handled above)
            if t is not Any and issubclass(annotation, t):
                return name
    return re.sub(r"\btyping\.|\bpathlib\.", "", str(annotation))


def constraints(field: FieldInfo) -> tuple[list[str], Optional[list[str]]]:
    """(bounds such as ``≥ 1``, ``> 0``; the words of a ``^(a|b)$`` pattern, or ``None``)."""
    bounds: list[str] = []
    choices: Optional[list[str]] = None
    symbols = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}
    for meta in field.metadata:
        for attr, symbol in symbols.items():
            bound = getattr(meta, attr, None)
            if bound is not None:
                bounds.append(f"{symbol} {toml_value(bound)}")
        if getattr(meta, "multiple_of", None) is not None:
            bounds.append(f"multiple of {toml_value(meta.multiple_of)}")
        if getattr(meta, "min_length", None) is not None:
            bounds.append(f"length ≥ {meta.min_length}")
        if getattr(meta, "max_length", None) is not None:
            bounds.append(f"length ≤ {meta.max_length}")
        pattern = getattr(meta, "pattern", None)
        if pattern is not None:
            pattern = getattr(pattern, "pattern", pattern)  # a compiled re.Pattern
            m = _ALTERNATION.match(pattern)
            if m:
                choices = m.group(1).split("|")
            else:
                bounds.append(f"matches `{pattern}`")
    return bounds, choices


def key_type(model: type[BaseModel], name: str, field: FieldInfo) -> str:
    """The type column: the type (or the closed set of values), the kind of value, the bounds."""
    bounds, choices = constraints(field)
    kind = value_kind(model, name, field)
    if choices is not None:
        text = " | ".join(json.dumps(c) for c in choices)
    elif kind is not None:
        text = kind
    else:
        text = type_text(field.annotation)
    return ", ".join([text, *bounds])


def _human_bytes(n: int) -> Optional[str]:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return None


def key_default(model: type[BaseModel], name: str, field: FieldInfo) -> str:
    """The default column: ``required``, ``unset`` or the default as TOML (sizes also in KiB/MiB/GiB)."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    text = f"`{toml_value(value)}`"
    if isinstance(value, int) and not isinstance(value, bool) and value_kind(model, name, field) == "size":
        human = _human_bytes(int(value))
        if human:
            text += f" ({human})"
    return text


# ---------------------------------------------------------------------------------------------
# text


def cell(text: str) -> str:
    """Text fit for one Markdown table cell (one line, pipes escaped)."""
    return " ".join(text.split()).replace("|", "\\|")


def prose(text: str) -> str:
    """Docstring reST to Markdown: ``code`` → `code`, :role:`~a.b.c` → `c` (or `a.b.c`)."""
    text = re.sub(r":\w+:`~[\w.]*?\.?(\w+)`", r"`\1`", text)
    text = re.sub(r":\w+:`([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    return text


def own_doc(cls: type) -> str:
    """A class's own docstring (not an inherited one), cleaned, reST roles converted, without a
    leading "``[section]``: " (the heading says it)."""
    doc = cls.__dict__.get("__doc__")
    if not doc:
        return ""
    doc = re.sub(r"^`\[+[\w.]+\]+`:\s*", "", prose(inspect.cleandoc(doc)))
    return doc[:1].upper() + doc[1:]


def first_sentence(doc: str) -> str:
    """The first sentence of a docstring's first paragraph (a full stop before a capital letter)."""
    para = " ".join(doc.split("\n\n")[0].split())
    m = re.match(r"(.+?\.)\s+(?=[A-Z])", para)
    return (m.group(1) if m else para).strip()


# ---------------------------------------------------------------------------------------------
# the page


class Page:
    """Collects the Markdown of ``docs/config.md`` and the keys that lack a description."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.undocumented: list[str] = []
        self.toc: list[tuple[int, str, str, str]] = []  # (level, title, anchor, summary)

    def section(self, model: type[BaseModel], dotted: str, array: bool, level: int, more: str = "") -> None:
        """One section's heading, docstring (then ``more``), key table, then its nested sections."""
        title = f"[[{dotted}]]" if array else f"[{dotted}]"
        doc = own_doc(model)
        self.toc.append((level, title, anchor(title), first_sentence(doc or more)))
        doc = "\n\n".join(d.strip() for d in (doc, more) if d.strip())
        self.lines += [f"{'#' * level} `{title}`", ""]
        if doc:
            self.lines += [doc, ""]
        rows, nested = [], []
        for name, field in model.model_fields.items():
            sub = _model_in(field.annotation)
            if sub is not None:
                nested.append((name, field, *sub))
                continue
            description = field.description or ""
            if not description:
                self.undocumented.append(f"{dotted}.{name}")
                description = "*(no description)*"
            rows.append(
                f"| `{name}` | {cell(key_type(model, name, field))} | {cell(key_default(model, name, field))} "
                f"| {cell(description)} |"
            )
        if rows:
            self.lines += ["| key | type | default | description |", "| --- | --- | --- | --- |", *rows, ""]
        for name, field, how, sub_model in nested:
            # the nested model's own docstring says more than the field's description, if it has one
            more = "" if own_doc(sub_model) else (field.description or "")
            self.section(sub_model, f"{dotted}.{name}", how == "array", min(level + 1, 4), more)


def anchor(title: str) -> str:
    """GitHub's heading anchor of a heading consisting of `title` in backticks."""
    text = title.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


HEADER = """\
# Config reference

<!-- Generated by scripts/gen_docs.py from the pydantic models in src/trainguard (sections.py,
     slurm/section.py, watch/config.py). Do not edit by hand: change the Field descriptions and run
     `.venv/bin/python scripts/gen_docs.py`; tests/test_docs.py fails when this file is stale. -->

One TOML file, one section per component. Every command takes `--config FILE` and any number of
`--set section.key=value` overrides (applied in order after the file; the value is read as a TOML
value when it is one — `20`, `1e-3`, `true`, `["a", "b"]`, `"text"` — else as plain text). Unknown
keys, wrong types and out-of-range values are errors that name the file or `--set`, the key and what
was expected (with the nearest valid key for a typo); the command exits with code 2. The resolved
config is written to `RUN_DIR/config.toml`.

```toml
[checkpoint]
interval = 500
async_save = true

[checkpoint.local]
dir = "/dev/shm/trainguard/{host}"

[[faults.inject]]
kind = "rank_killed"
rank = 1
step = 40
```

Under `trainguard run`, the launcher passes its `--config` and `--set` to every rank, which applies
them before the script's own. A script adds sections of its own by subclassing `trainguard.Config`
(see `examples/gpt.py`):

```python
class TrainSection(trainguard.Section):
    max_steps: int = Field(1000, ge=1, description="optimizer steps of the whole run")

class MyConfig(trainguard.Config):
    train: TrainSection = TrainSection()

cfg = trainguard.config_from_argv(MyConfig)
```

A script whose command line is its own (argparse, a configurator) uses
`trainguard.config_from_env(MyConfig)` instead: it reads only what the launcher passed
(`trainguard run --config train.toml --set k=v train.py --its --own --args`) and leaves `sys.argv`
to the script (`examples/own_cli.py`).

**Types.** `"a" | "b"`: one of these strings. *duration*: seconds as a number, or text such as
`"90s"`, `"30m"`, `"4h"`, `"1d2h"` or `"01:30:00"`. *size*: bytes as a number, or text such as
`"512MiB"`, `"20GiB"` or `"2GB"` (`GiB` = 2³⁰, `GB` = 10⁹). *unset*: the key is off (or chosen
automatically, as its description says) unless given.
"""

WATCH_INTRO = """\
Not part of the run's config file: `trainguard watch RUN_DIR` takes these as `--set key=value`
(`watch.key=value` is accepted too); `--notify URL` adds to `notify` and `--every 5m` sets `every`.
"""


def render() -> tuple[str, list[str]]:
    """The text of ``docs/config.md`` and the dotted keys that have no description."""
    sys.path.insert(0, str(ROOT / "src"))
    from trainguard.config import Config

    page = Page()
    for name, field in Config.model_fields.items():
        sub = _model_in(field.annotation)
        if sub is None:
            raise SystemExit(f"gen_docs.py: Config.{name} is not a section (a pydantic model); cannot document it")
        page.section(sub[1], name, sub[0] == "array", 2)
    try:
        from trainguard.watch.config import WatchSection
    except ImportError:
        WatchSection = None
    if WatchSection is not None:
        page.section(WatchSection, "watch", False, 2, WATCH_INTRO)
    toc = ["## Sections", ""]
    for level, title, link, summary in page.toc:
        indent = "  " * (level - 2)
        toc.append(f"{indent}* [`{title}`](#{link})" + (f": {summary}" if summary else ""))
    text = HEADER + "\n" + "\n".join(toc) + "\n\n" + "\n".join(page.lines).rstrip() + "\n"
    return text, page.undocumented


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Generate docs/config.md from the config schema.")
    parser.add_argument(
        "--check", action="store_true", help="do not write; exit 1 if docs/config.md is missing or stale"
    )
    parser.add_argument("--output", type=Path, default=TARGET, help="where to write (default docs/config.md)")
    args = parser.parse_args(argv)
    text, undocumented = render()
    for key in undocumented:
        print(f"gen_docs.py: warning: {key} has no description (Field(description=...))", file=sys.stderr)
    shown = args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output
    if args.check:
        try:
            current = args.output.read_text()
        except FileNotFoundError:
            current = None
        if current != text:
            state = "missing" if current is None else "stale"
            print(
                f"gen_docs.py: {shown} is {state} (the config schema changed); "
                f"regenerate it with: .venv/bin/python scripts/gen_docs.py",
                file=sys.stderr,
            )
            return 1
        print(f"gen_docs.py: {shown} is up to date")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"gen_docs.py: wrote {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
