"""Chain-step templates: `{previous}` and `{input}` substituted, `{{` and `}}` literal braces,
nothing else.

Templates come from clients (`/v1/chain/execute` takes one per request), so they must not be
`str.format` strings: a format spec like `{input:>50000000}` builds a 50 MB string per step, and
`{input.__class__}` walks attributes. This language has no specs, conversions, indexing or
attributes; anything in braces other than the two names is a problem reported up front, and
rendering is one pass whose output is the template's text plus the substituted values.
The valid templates of the str.format days mean the same here.
"""

from __future__ import annotations

import re

FIELDS = ("previous", "input")
# `{{` / `}}` first, so `{{input}}` stays the literal text `{input}` as it did with str.format.
_TOKEN = re.compile(r"\{\{|\}\}|\{(previous|input)\}|[{}]")
_SHOWN = 40  # characters of an offending field quoted in a message


class TemplateError(ValueError):
    pass


def template_problem(template: str) -> str | None:
    """Why `template` is not valid, or None when it is."""
    for match in _TOKEN.finditer(template):
        token = match.group(0)
        if token in ("{{", "}}") or match.group(1):
            continue
        if token == "}":
            return (f"single '}}' at offset {match.start()}; write '}}}}' for a literal brace, "
                    "and use only {previous} and {input}")
        end = template.find("}", match.start())
        if end < 0:
            return (f"unclosed '{{' at offset {match.start()}; write '{{{{' for a literal "
                    "brace, and use only {previous} and {input}")
        field = template[match.start():end + 1]
        if len(field) > _SHOWN:
            field = field[:_SHOWN] + "…"
        return (f"unsupported field {field} at offset {match.start()}: only {{previous}} and "
                "{input} are substituted (no format specs, conversions, indexes or attributes); "
                "write '{{' and '}}' for literal braces")
    return None


def render_template(template: str, *, previous: str, input: str) -> str:
    """`template` with its fields substituted; TemplateError when template_problem() objects."""
    values = {"previous": previous, "input": input}
    parts: list[str] = []
    at = 0
    for match in _TOKEN.finditer(template):
        parts.append(template[at:match.start()])
        at = match.end()
        token = match.group(0)
        if match.group(1):
            parts.append(values[match.group(1)])
        elif token in ("{{", "}}"):
            parts.append(token[0])
        else:
            raise TemplateError(template_problem(template) or f"stray {token!r}")
    parts.append(template[at:])
    return "".join(parts)
