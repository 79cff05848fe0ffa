"""The function a Responses `custom` tool is shown to the model as, by vLLM 0.32
(`custom_tool_parameters`, `encode_custom_tool_input`) and SGLang 0.5 alike: one required
string property, `input`, which a call's free-form payload is wrapped in."""

from __future__ import annotations

import json

PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string",
                             "description": "The freeform text payload for this tool."}},
    "required": ["input"],
    "additionalProperties": False,
}  # fmt: skip
"""The shim function's parameters schema, in the engines' key order."""


def arguments(payload: str) -> str:
    """A custom tool call's payload as the shim function's arguments."""
    return json.dumps({"input": payload}, ensure_ascii=False)
