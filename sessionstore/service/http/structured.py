"""Structured output as the API takes it: chat's ``response_format`` and the Responses API's
``text.format``, one grammar request for the engine (the chat shape, which
:mod:`kernels.model.text.grammar` compiles with llguidance), and OpenAI's rules for a strict
schema, checked before anything is queued.

A strict schema (``strict: true``) is refused as OpenAI refuses it: the root is an object, every
object sets ``additionalProperties: false`` and lists every property in ``required``; the 400
names the place in the schema (``response_format.json_schema.schema.properties.address``).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sessionstore.service.errors import ApiError

FORMAT_TYPES = ("text", "json_object", "json_schema")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # keywords holding a list of schemas
SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")  # name -> schema
SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def subschemas(node: dict[str, Any], where: str) -> Iterator[tuple[Any, str]]:
    """The schemas directly inside ``node``, each with its place (``where.properties.a``)."""
    for key in SUBSCHEMA_MAPS:
        held = node.get(key)
        if isinstance(held, dict):
            yield from ((sub, f"{where}.{key}.{name}") for name, sub in held.items())
    for key in SUBSCHEMA_LISTS:
        held = node.get(key)
        if isinstance(held, list):
            yield from ((sub, f"{where}.{key}.{i}") for i, sub in enumerate(held))
    for key in SUBSCHEMA_ONE:
        held = node.get(key)
        if isinstance(held, dict):
            yield held, f"{where}.{key}"
        elif key == "items" and isinstance(held, list):
            yield from ((sub, f"{where}.items.{i}") for i, sub in enumerate(held))


def is_object_schema(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node


def check_strict_schema(schema: Any, where: str) -> None:
    """OpenAI's rules for a strict schema; a 400 naming the first place that breaks one."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise ApiError(400, f"{where}: a strict schema's root must be an object schema (type: object)",
                       param=where, code="invalid_schema")
    todo: list[tuple[Any, str]] = [(schema, where)]
    while todo:
        node, at = todo.pop(0)
        if not isinstance(node, dict):
            continue
        if is_object_schema(node):
            if node.get("additionalProperties") is not False:
                raise ApiError(400, f"{at}: a strict schema's objects must set additionalProperties: false",
                               param=at, code="invalid_schema")
            properties = node.get("properties") or {}
            required = node.get("required") or []
            missing = [name for name in properties if not isinstance(required, list) or name not in required]
            if missing:
                raise ApiError(400, f"{at}.required: a strict schema lists every property in required; "
                               f"{', '.join(repr(m)[:80] for m in missing[:8])} missing", param=f"{at}.required",
                               code="invalid_schema")
        todo += [(sub, place) for sub, place in subschemas(node, at) if sub is not False]


def check_response_format(response_format: dict[str, Any], where: str = "response_format") -> None:
    """Chat's ``response_format`` (its type checked by the request): a ``json_schema`` one with
    ``json_schema.strict`` true is checked by OpenAI's rules (a schema that is missing or no object
    is the grammar compiler's to refuse, as one it cannot enforce)."""
    if response_format.get("type") != "json_schema":
        return
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        return
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(400, f"{where}.json_schema.strict must be true, false or null",
                       param=f"{where}.json_schema.strict", code="invalid_value")
    if strict:
        check_strict_schema(spec["schema"], f"{where}.json_schema.schema")


def text_format_of(text: Any) -> dict[str, Any]:
    """The Responses API's ``text.format`` as the response echoes it (``{"type": "text"}`` when not
    given); anything but OpenAI's three shapes is a 400 naming the field."""
    if text is None:
        return {"type": "text"}
    if not isinstance(text, dict):
        raise ApiError(400, 'text: must be an object ({"format": {...}})', param="text", code="invalid_type")
    fmt = text.get("format")
    if fmt is None:
        return {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in FORMAT_TYPES:
        raise ApiError(400, "text.format.type must be text, json_object or json_schema", param="text.format.type",
                       code="invalid_value")
    if kind != "json_schema":
        return {"type": kind}
    name, schema, strict = fmt.get("name"), fmt.get("schema"), fmt.get("strict")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "text.format.name: a json_schema format needs a name", param="text.format.name")
    if not isinstance(schema, dict):
        raise ApiError(400, "text.format.schema: give the JSON schema (an object)", param="text.format.schema",
                       code="invalid_schema")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(400, "text.format.strict must be true, false or null", param="text.format.strict",
                       code="invalid_value")
    if strict:
        check_strict_schema(schema, "text.format.schema")
    description = fmt.get("description")
    return {"type": "json_schema", "name": name, "schema": schema, "strict": bool(strict),
            "description": description if isinstance(description, str) else None}


def response_format_of(text_format: dict[str, Any]) -> dict[str, Any] | None:
    """The grammar request (chat's ``response_format`` shape) for a Responses ``text.format``
    (:func:`text_format_of`'s); None for free text."""
    kind = text_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": text_format["name"], "schema": text_format["schema"],
                                                   "strict": text_format["strict"]}}


__all__ = ["FORMAT_TYPES", "check_response_format", "check_strict_schema", "is_object_schema",
           "response_format_of", "subschemas", "text_format_of"]
