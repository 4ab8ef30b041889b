"""The C engines' error convention: a call returns nonzero and the engine writes a text;
the extension's one ``_check`` raises DistBackendError with that text, expanded here.

The engines know codes, not the names the front end gives things, so their texts carry
placeholders: ``{dtype:N}`` the dtype of code N, ``{rank:N}`` rank N of the group by its
name there (its global rank, where the group has a table of names), ``{mismatch}`` the
fingerprint mismatch the engine recorded and ``{failure}`` the group's recorded failure,
both described by the caller (which reads the engine's record).
"""
import re

from .dtypes import DTYPE_NAMES

_FIELD = re.compile(r"\{(dtype|rank):(-?\d+)\}")


def expand(text, names=None, mismatch=None, failure=None):
    """``text`` with its placeholders filled in. ``names``: rank r's name is names[r];
    ``mismatch``/``failure``: callables returning the description (or None)."""
    if "{" not in text:
        return text

    def field(m):
        v = int(m.group(2))
        if m.group(1) == "dtype":
            return DTYPE_NAMES.get(v, f"dtype {v}")
        return str(names[v]) if names and 0 <= v < len(names) else str(v)

    text = _FIELD.sub(field, text)
    if "{mismatch}" in text:
        text = text.replace("{mismatch}", (mismatch and mismatch())
                            or "a peer called a different collective")
    if "{failure}" in text:
        text = text.replace("{failure}", (failure and failure()) or "the group failed")
    return text
