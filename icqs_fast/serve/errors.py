"""The server's errors: :class:`APIError` (a status, message, code and the field it names),
OpenAI's error body, the error answers every route documents, and FastAPI's validation errors
as 400s naming the field.

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
request (an unknown or unsupported field names itself in ``param``; a limit names its flag in
the message), 401 for a missing or wrong key, 404 for an unknown model or route, 413 for a body
or request over its limit, 429 when the queue is full, 503 while shutting down, 504 past the
deadline; a failure inside the engine is a 500 with its message and never stops the server.
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError

from icqs_fast.serve.schemas import ErrorDetail, ErrorResponse

# What a client that went away is logged with (nginx's "client closed request"; never sent).
CLIENT_CLOSED = 499


class APIError(Exception):
    """A request's error: its status, message, code and (optionally) the field it names."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers
        self.param = param


_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "server_error", 504: "timeout_error", CLIENT_CLOSED: "client_closed"}


def error_body(status: int, message: str, code: str | None = None,
               param: str | None = None) -> dict:
    """OpenAI's error object (:class:`icqs_fast.serve.schemas.ErrorResponse`) as a dict."""
    return ErrorResponse(error=ErrorDetail(message=message,
                                           type=_ERROR_TYPE.get(status, "error"),
                                           param=param, code=code)).model_dump()


# Documented on every route of the schema (a fuzzer checks each answer's status against it).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorResponse, "description": d} for s, d in (
        (400, "bad request (the field in error.param; a limit names its flag)"),
        (401, "missing or wrong API key"), (404, "unknown model"),
        (413, "body or request over its limit"),
        (429, "queue full; retry after Retry-After seconds"), (500, "engine failure"),
        (503, "shutting down"), (504, "deadline (--request-timeout) passed"))}


# pydantic's error types that are union-member tags in an error's location, not fields.
_LOC_TAGS = {"str", "int", "bool", "float", "none", "list", "dict"}


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's validation error as a 400 naming the field (``param``). The offending input is
    never echoed (it may not even be encodable, e.g. a lone surrogate)."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request", "invalid_request")
    e = errors[0]
    parts: list[str] = []
    for x in e.get("loc", ())[1:] if e.get("loc", ("",))[0] == "body" else e.get("loc", ()):
        if isinstance(x, int):
            parts.append(f"[{x}]")
        elif x in _LOC_TAGS or any(c in x for c in "[(-"):
            continue
        else:
            parts.append(("." if parts else "") + x)
    param = "".join(parts) or None
    kind = e.get("type", "")
    if kind == "json_invalid":
        return APIError(400, "the body is not valid JSON", "invalid_json")
    if param is None and kind in ("model_attributes_type", "dict_type", "missing",
                                  "model_type"):
        return APIError(400, "the body must be a JSON object", "invalid_json")
    if kind == "extra_forbidden":
        return APIError(400, f"unsupported field '{param}': this server does not implement it "
                        "(see /openapi.json for the fields it reads)", "unsupported_field",
                        param=param)
    if kind == "missing":
        return APIError(400, f"'{param}' is required", "invalid_request", param=param)
    return APIError(400, f"'{param}': {e.get('msg', 'invalid value')}", "invalid_request",
                    param=param)


__all__ = ["CLIENT_CLOSED", "ERROR_RESPONSES", "APIError", "error_body", "validation_error"]
