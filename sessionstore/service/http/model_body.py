"""A request body as its protocol model (pydantic): malformed JSON, a wrong field or a missing one
is a 400 naming the field by its path in the body, never by the validation library's names for
the types it tried (``prompt.str``); a model may describe a field's shapes in ``shapes``
(``{"prompt": "a string or ..."}``, list indexes as ``*``) for the message."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from sessionstore.service.errors import ApiError
from sessionstore.service.http.jsonbody import read_json_body


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """A request body as ``model``: malformed JSON and wrong fields are 400s naming the field by its
    path in the body (never the validation library's names for the types it tried)."""
    obj = read_json_body(raw)
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        found = [(body_path(obj, e["loc"], e["type"] == "missing"), e) for e in exc.errors()]
        (path, tagged), first = max(found, key=lambda f: len(f[0][0]))  # the deepest: the union member that fit
        where = ".".join(str(p) for p in path) or None
        shapes: dict[str, str] = getattr(model, "shapes", {})
        shape = shapes.get(".".join("*" if isinstance(p, int) else str(p) for p in path))
        if shape is not None:
            message = f"must be {shape}"
        elif tagged:  # a field of several types, none of which fits
            message = "has the wrong type"
        else:
            message = str(first["msg"])
            message = message[:1].lower() + message[1:]
        raise ApiError(400, f"{where}: {message}" if where else message, param=where) from None


def body_path(obj: Any, loc: tuple[int | str, ...], missing: bool) -> tuple[list[int | str], bool]:
    """The path in the body ``obj`` of a validation error at ``loc``: the keys and indexes the body
    holds, without the names of the union members tried (``prompt.str``); whether any was left out."""
    path: list[int | str] = []
    here, tagged = obj, False
    for i, part in enumerate(loc):
        if isinstance(part, int) and isinstance(here, list) and 0 <= part < len(here):
            path.append(part)
            here = here[part]
        elif isinstance(part, str) and isinstance(here, dict) and (part in here or (missing and i == len(loc) - 1)):
            path.append(part)
            here = here.get(part)
        else:
            tagged = True  # a union member's name: not in the body
    return path, tagged


__all__ = ["body_path", "parse_body"]
