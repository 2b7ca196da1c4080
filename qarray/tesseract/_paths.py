"""Differentiable paths (``layers.[1].w_q.scale``) looked up in a request."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel

_INDEX = re.compile(r"\[(\d+)\]")


def lookup_path(inputs: BaseModel, path: str) -> Any:
    """The value at ``path`` in a validated request (attributes joined by
    ``.``, list items as ``[i]``), or a ValueError naming the path when the
    request did not give it. A model whose fields are alternatives declares
    them (``exclusive = ("w", "w_q")``, a ClassVar) so that the message says
    which one was given."""
    value: Any = inputs
    where = ""
    for part in path.split("."):
        index = _INDEX.fullmatch(part)
        if index is not None:
            i = int(index.group(1))
            if not isinstance(value, list) or i >= len(value):
                count = len(value) if isinstance(value, list) else 0
                raise ValueError(
                    f"{path!r} names item {i} of {where}, but the request has {count}"
                )
            value, where = value[i], f"{where}.[{i}]"
            continue
        parent, value = value, getattr(value, part, None)
        if value is None:
            given = [
                name
                for name in getattr(parent, "exclusive", ())
                if name != part and getattr(parent, name, None) is not None
            ]
            hint = f" ({where} gave {', '.join(given)})" if given else ""
            raise ValueError(f"{path!r} names an array this request did not give{hint}")
        where = f"{where}.{part}" if where else part
    return value
