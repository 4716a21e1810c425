"""Tool-call arguments in one canonical form: the judge reads what a call means, not how its JSON
was written.

A JSON object is unordered: ``{"image": "a.png", "resolution": "2K"}`` and the same keys the
other way round are one call. Rendered in the order the policy emitted them they are different
text, so the judge would score them differently, and an RL policy could search key orders for
reward. Both renderers (the judge's transcript and the policy's SFT target) therefore write
arguments in a canonical order:

* an object's keys in the order of its JSON schema's ``properties`` (for the call's arguments:
  the schema of the tool of that name in the sample's ``tools``, the order the policy read them
  in), then the keys the schema does not name, sorted;
* an object without a schema (an unlisted tool, a free-form nested value): its keys sorted;
* recursively, nested objects with their property's schema, array items with ``items``.

Whitespace needs no rule here: a string of arguments is decoded at parse time
(``schema.decode_arguments``) and the renderer serialises the value again, so the incoming
whitespace never reaches the tokens. Undecodable arguments stay the raw string: the judge must
see what the policy emitted.
"""

from __future__ import annotations

from typing import Any, Sequence

from rm_jax.data.schema import ToolCall


def _properties(schema: Any) -> dict:
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def _items(schema: Any) -> Any:
    return schema.get("items") if isinstance(schema, dict) else None


def tool_parameters(tools: Sequence[dict], name: str) -> dict | None:
    """The ``parameters`` schema of the first listed tool called ``name`` (OpenAI
    ``{"type": "function", "function": {...}}`` or a bare function object); None when unlisted."""
    for tool in tools:
        fn = tool["function"] if isinstance(tool.get("function"), dict) else tool
        if fn.get("name") == name:
            params = fn.get("parameters")
            return params if isinstance(params, dict) else None
    return None


def canonical_value(value: Any, schema: Any = None) -> Any:
    """``value`` with every object's keys in canonical order (schema order, then sorted)."""
    if isinstance(value, dict):
        props = _properties(schema)
        keys = [k for k in props if k in value] + sorted(k for k in value if k not in props)
        return {k: canonical_value(value[k], props.get(k)) for k in keys}
    if isinstance(value, list):
        items = _items(schema)
        return [canonical_value(v, items) for v in value]
    return value


def canonical_arguments(call: ToolCall, tools: Sequence[dict]) -> Any:
    """A call's arguments as both renderers write them; a raw (undecodable) string unchanged."""
    if isinstance(call.arguments, str):
        return call.arguments
    return canonical_value(call.arguments, tool_parameters(tools, call.name))
