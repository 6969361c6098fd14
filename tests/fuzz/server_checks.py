"""Schemathesis' positive-data check, excusing only the 400s the document marks with ``x-hypha-server-check``.

A request valid by the document's schemas must be accepted, except where the
document says the server checks more than JSON Schema can (a rule across
fields, a value the server parses): there it may get a 400 whose error names
a key so marked. Any other refusal of valid data fails as schemathesis' own
check would: the document and the server disagree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema_rs
import schemathesis
from schemathesis.openapi.checks import RejectedPositiveData

from hypha.scheduler.openapi_jobs import SERVER_CHECK


@dataclass(frozen=True)
class Mark:
    """One ``x-hypha-server-check`` a request body reaches: the body path it applies to, and how far."""

    path: tuple[str, ...]
    #: "key": an error naming exactly this key; "inside": this key or any key in it; "any": any key
    #: (a value in another format, whose errors name keys of that format).
    scope: str
    rule: str


def _resolve(schema: Any, document: dict[str, Any]) -> Any:
    while isinstance(schema, dict) and "$ref" in schema:
        node: Any = document
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def _inline(schema: Any, document: dict[str, Any]) -> Any:
    """``schema`` with every ``$ref`` replaced by what it names (the document has no recursive schema)."""
    schema = _resolve(schema, document)
    if isinstance(schema, dict):
        return {k: _inline(v, document) for k, v in schema.items() if k != "discriminator"}
    if isinstance(schema, list):
        return [_inline(v, document) for v in schema]
    return schema


def valid(schema: Any, instance: Any, document: dict[str, Any]) -> bool:
    """Whether ``instance`` is valid by ``schema`` (a schema of ``document``), as schemathesis judges it."""
    return bool(jsonschema_rs.Draft202012Validator(_inline(schema, document)).is_valid(instance))


def marks(schema: Any, instance: Any, document: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[Mark]:
    """Every server-check mark on the schemas ``instance`` passes through (array indices left out)."""
    schema = _resolve(schema, document)
    if not isinstance(schema, dict):
        return
    mark = schema.get(SERVER_CHECK)
    if isinstance(mark, dict):
        for key, rule in mark.items():
            yield Mark((*path, key), "key", rule)
    elif isinstance(mark, str):
        if "contentMediaType" in schema:
            yield Mark(path, "any", mark)
        else:
            yield Mark(path, "inside" if isinstance(instance, dict) else "key", mark)
    for branch in schema.get("oneOf", []) + schema.get("anyOf", []) + schema.get("allOf", []):
        if valid(branch, instance, document):
            yield from marks(branch, instance, document, path)
    if isinstance(instance, dict):
        properties = schema.get("properties", {})
        for key, value in instance.items():
            sub = properties.get(key, schema.get("additionalProperties"))
            yield from marks(sub, value, document, (*path, key))
    elif isinstance(instance, list) and "items" in schema:
        for item in instance:
            yield from marks(schema["items"], item, document, path)


def _names(key: str, path: tuple[str, ...]) -> bool:
    """Whether the error key names the body path (the server may put its table's name first: task.gpus)."""
    dotted = ".".join(path)
    return key == dotted or key.endswith("." + dotted)


def excuses(mark: Mark, key: str) -> bool:
    """Whether ``mark`` documents a 400 whose error names ``key``."""
    if mark.scope == "any":
        return True
    if mark.scope == "key":
        return _names(key, mark.path)
    parts = key.split(".")
    return any(_names(".".join(parts[:n]), mark.path) for n in range(1, len(parts) + 1))


def error_key(content: bytes) -> str:
    """The key a hypha error names (``task.retry.backoff_cap_s: must be ...``), array indices dropped."""
    try:
        message = json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ""
    if not isinstance(message, str) or ": " not in message:
        return ""
    return re.sub(r"\[\d+\]", "", message.split(": ", 1)[0])


def request_schema(document: dict[str, Any], path: str, method: str, media_type: str) -> Any:
    """The schema of an operation's request body of ``media_type`` (None: the operation takes none)."""
    operation = document["paths"][path][method.lower()]
    content = operation.get("requestBody", {}).get("content", {})
    return content.get(media_type, {}).get("schema")


def documented_refusal(document: dict[str, Any], schema: Any, body: Any, status: int, content: bytes) -> bool:
    """Whether the document says a valid ``body`` may get this answer (a 400 at a marked key)."""
    key = error_key(content)
    if status != 400 or schema is None or not key:
        return False
    return any(excuses(mark, key) for mark in marks(schema, body, document))


def positive_data_acceptance_but_server_checks(document: dict[str, Any]) -> Any:
    """Schemathesis' ``positive_data_acceptance``, except for the 400s ``document`` marks."""

    def positive_data_acceptance_except_documented(
        ctx: Any, response: schemathesis.Response, case: schemathesis.Case
    ) -> bool | None:
        try:
            return schemathesis.checks.positive_data_acceptance(ctx, response, case)
        except RejectedPositiveData:
            schema = request_schema(document, case.path, case.method, case.media_type or "")
            if documented_refusal(document, schema, case.body, response.status_code, response.content):
                return None
            raise

    return positive_data_acceptance_except_documented


__all__ = [
    "Mark",
    "documented_refusal",
    "error_key",
    "excuses",
    "marks",
    "positive_data_acceptance_but_server_checks",
    "request_schema",
    "valid",
]
