"""What a tool is to the model: a name, a description and a JSON schema of its arguments.

A Python function's schema comes from its type hints and its docstring through pydantic, as
the MCP SDK builds its servers' schemas; an MCP server's comes from its `tools/list`. Every
call's arguments are checked against the schema before the tool runs, so a call the model got
wrong is answered with the reason rather than reaching the tool.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import create_model


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    source: str  # "function:module:callable" or "mcp:<server>"

    def openai(self) -> dict[str, Any]:
        """The form chat templates take (`apply_chat_template(tools=...)`)."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


def function_spec(fn: Callable[..., Any], source: str) -> ToolSpec:
    """The spec of a plain Python function: every parameter needs a type hint."""
    name = getattr(fn, "__name__", "")
    sig = inspect.signature(fn)
    fields: dict[str, Any] = {}
    for param in sig.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ValueError(f"tool {source}: *args/**kwargs have no schema; name each argument")
        if param.annotation is param.empty:
            raise ValueError(f"tool {source}: argument {param.name!r} has no type hint (its "
                             "schema comes from the hints)")
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (param.annotation, default)
    model = create_model(f"{name}Arguments", **fields)
    schema = model.model_json_schema()
    schema.pop("title", None)
    doc = inspect.getdoc(fn) or ""
    return ToolSpec(name, doc.split("\n\n", 1)[0].strip(), schema, source)


def argument_errors(spec: ToolSpec, arguments: Any) -> str:
    """Why `arguments` do not fit the spec's schema ("" when they do)."""
    import jsonschema  # the mcp SDK's dependency; imported where calls are checked

    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, not {type(arguments).__name__}"
    errors = sorted(jsonschema.Draft202012Validator(spec.parameters).iter_errors(arguments),
                    key=lambda e: list(e.path))
    return "; ".join(f"{'.'.join(map(str, e.path)) or 'arguments'}: {e.message}"
                     for e in errors[:3])
