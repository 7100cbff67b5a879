"""The checks on JSON a node or Redis gives back (a manifest, a blob span), field by
field: every problem is one ManifestError that names it, never a KeyError or TypeError
from deep inside a parse.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

from smoltorrent.errors import ManifestError

SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # a SHA-256 as manifests, spans and version ids write it
# What json.loads raises on text that is not JSON smoltorrent could have written, besides
# JSONDecodeError (a ValueError too): a number of over 4,300 digits (ValueError), nesting
# deeper than the stack (RecursionError). A node's copy is input like any other: every one
# of these is a ManifestError, so a rebuild or a crosscheck skips that copy and goes on.
NOT_JSON = (ValueError, UnicodeDecodeError, RecursionError)


def fail(problem: str) -> NoReturn:
    raise ManifestError(
        f"invalid manifest: {problem}. It is corrupt or was not written by smoltorrent; "
        "read the copy another node keeps, or store the checkpoint again."
    )


def reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            fail(f"a JSON object repeats the key {key!r}")
        result[key] = value
    return result


def checked_fields(
    document: Any, expected: set[str], what: str, optional: frozenset[str] = frozenset()
) -> dict[str, Any]:
    if not isinstance(document, dict):
        fail(f"{what} is not a JSON object")
    if missing := expected - document.keys():
        fail(f"{what} lacks {', '.join(sorted(missing))}")
    if unknown := document.keys() - expected - optional:
        fail(f"{what} has unknown fields {', '.join(sorted(unknown))}")
    return document


def checked_count(
    document: dict[str, Any], key: str, what: str, minimum: int = 0, maximum: int | None = None
) -> int:
    value = document[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        fail(f"{what} {key} is {shown(value)}, not an integer >= {minimum}")
    if maximum is not None and value > maximum:
        fail(f"{what} {key} is {shown(value)}, over {maximum}")
    return value


def shown(value: Any) -> str:
    """A value for an error message, cut short: a hostile one may be thousands of digits."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else "huge"
    return text if len(text) <= 80 else text[:77] + "..."


def checked_sha256(document: dict[str, Any], key: str, what: str) -> str:
    value = document[key]
    if not isinstance(value, str) or not SHA256_HEX.fullmatch(value):
        fail(f"{what} {key} is {value!r}, not 64 lowercase hex digits")
    return value
