"""The recipe reference (docs/recipe-reference.md), rendered from the pydantic schema.

Every section of `Recipe` and every field in it: the key, its type (Literal choices spelled
out), its default and its description, nested sections under their dotted name. The page is
generated so it cannot drift from the schema; a test compares it with this module's output.

    python -m accord.recipe.reference            # write docs/recipe-reference.md
    python -m accord.recipe.reference --check    # exit 1 when the page is stale
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from accord.recipe.schema import Recipe

DEFAULT_PATH = Path(__file__).resolve().parents[3] / "docs" / "recipe-reference.md"
COMMAND = "python -m accord.recipe.reference"

HEADER = f"""# Recipe reference

Every key a recipe may set, section by section: its type, its default and what it does.
Generated from the recipe's schema (`src/accord/recipe/`) by `{COMMAND}`; do not edit by hand.
See [recipes.md](recipes.md) for how a recipe is written, overridden and used from Python.

A key without a default is required. `null` is YAML's empty value. A section's keys are set as
`section.key` on the command line (`accord train R.yaml optim.lr=1e-3`).
"""


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _options(annotation: Any) -> list[Any]:
    """The alternatives of a union (X | Y, Optional[X]), or [annotation] itself."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return [option for arg in typing.get_args(annotation) for option in _options(arg)]
    if typing.get_origin(annotation) is typing.Annotated:
        return _options(typing.get_args(annotation)[0])
    return [annotation]


def _section_models(annotation: Any) -> list[type[BaseModel]]:
    """The sections a field's value may be (directly, in a union or as list items), in order."""
    found: list[type[BaseModel]] = []
    for option in _options(annotation):
        if _is_model(option):
            found.append(option)
        elif typing.get_origin(option) in (list, tuple, dict):
            for arg in typing.get_args(option):
                found.extend(model for model in _section_models(arg) if model not in found)
    return found


def type_name(annotation: Any, links: dict[type[BaseModel], str]) -> str:
    """A field's type as a reader writes it in YAML: `"a"` | `"b"` for choices, sections linked."""
    parts = []
    for option in _options(annotation):
        origin = typing.get_origin(option)
        if option is type(None):
            parts.append("null")
        elif origin is Literal:
            parts.extend(json.dumps(value) for value in typing.get_args(option))
        elif origin is list:
            parts.append(f"list of {type_name(typing.get_args(option)[0], links)}")
        elif origin is tuple:
            parts.append("[" + ", ".join(type_name(arg, links) for arg in typing.get_args(option)) + "]")
        elif origin is dict:
            key, value = typing.get_args(option)
            parts.append(f"mapping of {type_name(key, links)} to {type_name(value, links)}")
        elif _is_model(option):
            parts.append(f"[{option.__name__}](#{links[option]})" if option in links else option.__name__)
        elif option is Any:
            parts.append("any")
        else:
            parts.append(getattr(option, "__name__", str(option)))
    return " \\| ".join(dict.fromkeys(parts))


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(the section's defaults)"
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, tuple):
        value = list(value)
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def _constraints(field: FieldInfo) -> str:
    words = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    found = [
        f"{words[name]} {getattr(item, name)}"
        for item in field.metadata
        for name in words
        if getattr(item, name, None) is not None
    ]
    return f" ({', '.join(found)})" if found else ""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _doc(model: type[BaseModel]) -> str:
    text = (model.__doc__ or "").strip()
    return " ".join(text.split())


def _walk(model: type[BaseModel], name: str, found: list[tuple[str, type[BaseModel]]]) -> None:
    """(dotted name, section model) for `model` and every section below it, depth first."""
    found.append((name, model))
    for key, field in model.model_fields.items():
        key = field.alias or key
        variants = _section_models(field.annotation)
        for sub in variants:
            if any(seen is sub for _, seen in found):
                continue
            label = f"{name}.{key}" if name else key
            if len(variants) > 1 and typing.get_origin(_options(field.annotation)[0]) is list:
                label = f"{label}[] ({sub.__name__})"
            elif len(variants) > 1:
                label = f"{label} ({sub.__name__})"
            _walk(sub, label, found)


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to dashes."""
    kept = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


def render(model: type[BaseModel] = Recipe) -> str:
    """The whole reference page for `model` (the Recipe), as markdown."""
    sections: list[tuple[str, type[BaseModel]]] = []
    _walk(model, "", sections)
    titles = {sub: (f"`{name}`" if name else "The recipe (top level)") for name, sub in sections}
    links = {sub: _anchor(title) for sub, title in titles.items()}
    out = [HEADER]
    out.append("Sections: " + ", ".join(f"[{titles[sub]}](#{links[sub]})" for _, sub in sections) + ".\n")
    for _, sub in sections:
        out.append(f"## {titles[sub]}\n")
        if _doc(sub):
            out.append(_doc(sub) + "\n")
        out.append("| key | type | default | description |")
        out.append("|---|---|---|---|")
        for key, field in sub.model_fields.items():
            sections_below = _section_models(field.annotation)
            description = field.description or (_doc(sections_below[0]) if sections_below else "")
            out.append(
                f"| `{field.alias or key}` | {type_name(field.annotation, links)}{_constraints(field)} "
                f"| `{_cell(default_text(field))}` | {_cell(description)} |"
            )
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Write the recipe reference page from the schema.")
    parser.add_argument("--check", action="store_true", help="exit 1 when PATH differs from the schema's page")
    parser.add_argument("path", nargs="?", type=Path, default=DEFAULT_PATH, help=f"default: {DEFAULT_PATH}")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        if not args.path.is_file() or args.path.read_text(encoding="utf-8") != page:
            print(f"{args.path} is stale: regenerate it with `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.path.parent.mkdir(parents=True, exist_ok=True)
    args.path.write_text(page, encoding="utf-8")
    print(f"wrote {args.path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
