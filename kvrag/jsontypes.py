"""The type of a free-form JSON document: what ``json.loads`` returns for text whose shape kvrag does not fix.

Documents with a fixed shape (stats records, store headers, calibration records) are ``TypedDict``s next to the code
that writes them; :data:`JSONValue` is for the rest (a method's parameters, a client's extra fields), and code that
reads one narrows it (``isinstance``, :func:`as_object`) before use.
"""

from __future__ import annotations

from typing import TypeAlias

JSONScalar: TypeAlias = str | int | float | bool | None
"""A JSON leaf: a string, a number, a boolean or null."""

JSONValue: TypeAlias = JSONScalar | list["JSONValue"] | dict[str, "JSONValue"]
"""A JSON value: a leaf, an array of values or an object mapping strings to values."""

JSONObject: TypeAlias = dict[str, JSONValue]
"""A JSON object (what a ``.json`` file holding ``{...}`` loads as)."""



def as_object(value: JSONValue) -> JSONObject:
    """``value`` when it is a JSON object, else an empty one (an optional object field that is missing or null)."""
    return value if isinstance(value, dict) else {}


__all__ = ["JSONObject", "JSONScalar", "JSONValue", "as_object"]
