"""The router's OpenAPI 3.1 document (`GET /openapi.json`), built from the shapes it already has.

Response and admin shapes come from their definitions: the msgspec structs of
`warply.protocol.api` and `warply.protocol.directives`, the pydantic `WorkerConfig` a joining
worker's body is validated with. The three OpenAI request bodies and the Anthropic Messages one
are written here and declare only what the router itself checks (`router.proxy`): every other
field passes to the engine unchanged, so the engine's own schema applies to it; so do the
forwarded /tokenize, /detokenize and /v1/messages/count_tokens bodies, of which the router
checks only `model`. The tests fuzz the router against this document.
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.config import RouterConfig, WorkerConfig
from warply.protocol.api import CacheStats, Overrides, Where, WorkerList, WorkerView
from warply.protocol.directives import Directive

_REF = "#/components/schemas/{name}"
_NULLABLE_INT = {"type": ["integer", "null"], "minimum": 0}

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {
                    "type": ["string", "integer", "null"],
                    "description": "the router's: a string; an engine's relayed error: vLLM "
                    "0.32 puts the HTTP status here",
                },
            },
        }
    },
}

_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}

_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}

_COMMON = {
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"]},
    "n": _NULLABLE_INT,
    "max_tokens": _NULLABLE_INT,
    "max_completion_tokens": _NULLABLE_INT,
    "add_special_tokens": {"type": ["boolean", "null"]},
    "warply": {"anyOf": [{"$ref": _REF.format(name="Overrides")}, {"type": "null"}]},
}

_COMPLETION: dict[str, Any] = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        **_COMMON,
        "prompt": {
            "anyOf": [
                {"type": "string"},
                _TOKEN_IDS,
                {
                    "type": "array",
                    "minItems": 1,
                    "items": {"anyOf": [{"type": "string"}, _TOKEN_IDS]},
                },
            ]
        },
    },
}

_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string"},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "null"},
                {
                    "type": "array",
                    "items": {
                        "anyOf": [
                            {
                                "type": "object",
                                "required": ["type", "text"],
                                "properties": {
                                    "type": {"const": "text"},
                                    "text": {"type": "string"},
                                },
                            },
                            {
                                "type": "object",
                                "description": "image, audio, video, ...: sent to the engine as "
                                "it came, the request placed by load",
                                "required": ["type"],
                                "properties": {
                                    "type": {"type": "string", "not": {"const": "text"}}
                                },
                            },
                        ]
                    },
                },
            ]
        },
    },
}

_CHAT: dict[str, Any] = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        **_COMMON,
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "chat_template_kwargs": {"type": ["object", "null"]},
        "chat_template": {
            "type": ["string", "null"],
            "description": "refused (400 untrusted_chat_template) unless the router's "
            "trust_request_chat_template is on",
        },
    },
}

_RESPONSES: dict[str, Any] = {
    "type": "object",
    "required": ["input"],
    "description": "the engine's Responses request: the router reads these fields (and keys "
    "text-only inputs by prefix); the rest goes to the engine as it came",
    "properties": {
        **_COMMON,
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}],
                  "description": "keyed by prefix when it is text only (docs/router.md)"},
        "instructions": {"type": ["string", "null"]},
        "max_output_tokens": _NULLABLE_INT,
        "previous_response_id": {
            "type": ["string", "null"],
            "description": "answered by the worker that stored it",
        },
        "request_id": {
            "type": ["string", "null"],
            "description": "the response's id; unset, the router makes one naming its worker",
        },
        "chat_template_kwargs": _CHAT["properties"]["chat_template_kwargs"],
    },
}

_MESSAGES: dict[str, Any] = {
    "type": "object",
    "required": ["messages"],
    "description": "the engine's Anthropic Messages request: the router reads these fields "
    "(and keys what vLLM converts to a chat it can follow by prefix); the rest goes to the "
    "engine as it came",
    "properties": {
        "stream": _COMMON["stream"],
        "max_tokens": _NULLABLE_INT,
        "warply": _COMMON["warply"],
        "messages": {"type": "array", "minItems": 1, "items": {"type": "object"}},
        "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}},
                             {"type": "null"}]},  # fmt: skip
        "chat_template_kwargs": _CHAT["properties"]["chat_template_kwargs"],
    },
}


_ACK = {
    "type": "object",
    "description": "`warply.protocol.events.DirectiveAck` as a JSON object",
    "required": ["directive_id", "applied", "reason", "blocks"],
    "properties": {
        "directive_id": {"type": "string"},
        "applied": {"type": "boolean"},
        "reason": {"type": "string"},
        "blocks": {"type": "integer"},
    },
}


def _json(schema: dict[str, Any] | str, description: str) -> dict[str, Any]:
    ref = {"$ref": _REF.format(name=schema)} if isinstance(schema, str) else schema
    return {"description": description, "content": {"application/json": {"schema": ref}}}


_SHAPES = {"Error": "OpenAI", "AnthropicError": "Anthropic"}
"""Each error component, by whose shape it has."""


def _errors(*statuses: int, shape: str = "Error") -> dict[str, Any]:
    return {str(s): _json(shape, f"an error in the {_SHAPES[shape]} shape") for s in statuses}


def _body(schema: dict[str, Any] | str) -> dict[str, Any]:
    return {"required": True, **_json(schema, "")}


def _generation(body: str, summary: str, error: str = "Error") -> dict[str, Any]:
    ok = _json({"type": "object"}, "the engine's answer (JSON, or SSE when streaming)")
    event = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
    ok["content"]["text/event-stream"] = {"schema": event}  # each server-sent event
    return {
        "post": {
            "summary": summary,
            "requestBody": _body(body),
            "responses": {"200": ok, **_errors(400, 404, 413, 415, 502, 503, 504, shape=error)},
        }
    }


def _forwarded(body: str | None, summary: str, error: str = "Error") -> dict[str, Any]:
    """A forwarded operation (`router.passthrough`); `body` None: it takes none."""
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {
            "200": _json({"type": "object"}, "the engine's answer"),
            **_errors(413, 415, 502, 503, 504, shape=error),
            "default": {
                "description": "the engine's own answer, errors included (plain text from "
                "an engine without the endpoint), or the router's own 400 / 404 (`model`)",
                "content": {
                    "application/json": {"schema": {}},
                    "text/plain": {"schema": {"type": "string"}},
                },
            },
        },
    }
    if body is not None:
        op["requestBody"] = _body(body)
    return op


def _admin(op: dict[str, Any]) -> dict[str, Any]:
    return {**op, "security": [{"bearer": []}], "responses": {**op["responses"], **_errors(401)}}


def _name(param: str) -> dict[str, Any]:
    return {"name": param, "in": "path", "required": True, "schema": {"type": "string"}}


def openapi_document(config: RouterConfig) -> dict[str, Any]:
    """The document for a router with `config` (its model names are the `model` values)."""
    _, components = msgspec.json.schema_components(
        (CacheStats, WorkerList, WorkerView, Overrides, Directive, Where),
        ref_template=_REF,
    )
    components["Error"] = _ERROR
    components["AnthropicError"] = _ANTHROPIC_ERROR
    components["DirectiveAck"] = _ACK
    names = [config.model, *config.lora_adapters, "", None]  # "" and none: the base model
    model = {"model": {"enum": names}}
    shapes = (("CompletionRequest", _COMPLETION), ("ChatCompletionRequest", _CHAT),
              ("ResponsesRequest", _RESPONSES), ("MessagesRequest", _MESSAGES))  # fmt: skip
    for name, shape in shapes:
        components[name] = {**shape, "properties": {**model, **shape["properties"]}}
    for name, what in (("TokenizeRequest", "prompt or messages"), ("DetokenizeRequest", "tokens"),
                       ("CountTokensRequest", "Anthropic messages")):  # fmt: skip
        components[name] = {
            "type": "object",
            "description": f"the engine's {name} ({what}), forwarded as it came",
            "properties": model,
        }
    components["WorkerConfig"] = WorkerConfig.model_json_schema()
    enabled = {"type": "object", "required": ["enabled"], "additionalProperties": False,
               "properties": {"enabled": {"type": "boolean"}}}  # fmt: skip
    directive = {
        "type": "object",
        "required": ["worker", "directive"],
        "properties": {"worker": {"type": "string"}, "directive": {"$ref": _REF.format(
            name="Directive")}},
    }
    text = {"description": "Prometheus text", "content": {"text/plain": {"schema": {}}}}
    paths: dict[str, Any] = {
        "/v1/completions": _generation("CompletionRequest", "a completion, placed and proxied"),
        "/v1/chat/completions": _generation("ChatCompletionRequest", "a chat completion"),
        "/v1/responses": _generation("ResponsesRequest", "a response, placed and proxied"),
        "/v1/messages": _generation(
            "MessagesRequest", "an Anthropic Messages request, placed and proxied",
            "AnthropicError",
        ),
        "/v1/messages/count_tokens": {
            "post": _forwarded(
                "CountTokensRequest", "the engine's token count, forwarded", "AnthropicError"
            )
        },
        "/v1/responses/{response_id}": {
            "parameters": [_name("response_id")],
            "get": _forwarded(None, "a stored response, from the worker that stored it"),
        },
        "/v1/responses/{response_id}/cancel": {
            "parameters": [_name("response_id")],
            "post": _forwarded(None, "cancel a background response on its worker"),
        },
        "/tokenize": {
            "post": _forwarded("TokenizeRequest", "the engine's tokenization, forwarded")
        },
        "/detokenize": {
            "post": _forwarded("DetokenizeRequest", "the engine's detokenization, forwarded")
        },
        "/v1/models": {"get": {"responses": {"200": _json({"type": "object"}, "served models")}}},
        "/health": {
            "get": {
                "responses": {
                    "200": _json({"type": "object"}, "some worker is healthy"),
                    "503": _json({"type": "object"}, "no healthy worker"),
                }
            }
        },
        "/metrics": {"get": {"responses": {"200": text}}},
        "/openapi.json": {"get": {"responses": {"200": _json({"type": "object"}, "this")}}},
        "/warply/cache_stats": {
            "get": _admin({"responses": {"200": _json("CacheStats", "cache statistics")}})
        },
        "/warply/workers": {
            "get": _admin({"responses": {"200": _json("WorkerList", "the workers")}})
        },
        "/warply/workers/{name}": {
            "parameters": [_name("name")],
            "post": _admin(
                {
                    "requestBody": _body(enabled),
                    "responses": {
                        "200": _json({"type": "object"}, "drained or restored"),
                        **_errors(400, 404, 409, 413, 415),
                    },
                }
            ),
            "delete": _admin(
                {
                    "parameters": [
                        {"name": "wait", "in": "query", "schema": {"enum": ["true", "false"]}}
                    ],
                    "responses": {
                        "200": _json({"type": "object"}, "removed"),
                        "202": _json({"type": "object"}, "leaving"),
                        **_errors(404),
                    },
                }
            ),
        },
        "/warply/pools/{pool}/workers": {
            "parameters": [_name("pool")],
            "post": _admin(
                {
                    "requestBody": _body("WorkerConfig"),
                    "responses": {
                        "201": _json("WorkerView", "the joined worker"),
                        **_errors(400, 404, 409, 413, 415),
                    },
                }
            ),
        },
        "/warply/where": {
            "get": _admin(
                {
                    "parameters": [
                        {"name": n, "in": "query", "required": n == "prompt",
                         "schema": {"type": "string"}}
                        for n in ("prompt", "model", "cache_key")
                    ],  # fmt: skip
                    "responses": {
                        "200": _json("Where", "holdings and choice"),
                        **_errors(400, 404),
                    },
                }
            ),
            "post": _admin(
                {
                    "parameters": [{"name": "api", "in": "query", "required": False,
                                    "schema": {"enum": ["messages"]},
                                    "description": "the body is an Anthropic Messages one"}],
                    "requestBody": _body({"anyOf": [{"$ref": _REF.format(name=n)} for n in (
                        "CompletionRequest", "ChatCompletionRequest", "MessagesRequest"
                    )]}),  # fmt: skip
                    "responses": {
                        "200": _json("Where", "holdings and choice"),
                        **_errors(400, 404, 413, 415),
                    },
                }
            ),
        },
        "/warply/directives": {
            "post": _admin(
                {
                    "requestBody": _body(directive),
                    "responses": {
                        "200": _json("DirectiveAck", "the plugin's answer"),
                        **_errors(400, 404, 413, 415, 502, 504),
                    },
                }
            )
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "warply-router", "version": "1", "description": __doc__},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
