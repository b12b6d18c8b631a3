"""Errors as each API shapes them: OpenAI's (`APIError`, `error_response`) or, on the Messages API's routes,
Anthropic's (`shaped`); a body that fails validation; a request refused while the LLM is away."""

from __future__ import annotations

import json
from collections import Counter

from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.kind, self.headers)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   kind: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


MESSAGES_PATH = "/v1/messages"  # Anthropic's Messages API (serving/messages.py), whose errors have its shape


def error_type(status: int) -> str:
    """OpenAI's error type for a status: the server's fault from 500 on, else the request's."""
    return "server_error" if status >= 500 else "invalid_request_error"


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                         429: "rate_limit_error", 503: "overloaded_error"}


def shaped(path: str, response: Response) -> Response:
    """An error answer as the API at `path` shapes errors: OpenAI's (`error_response`), or on the Messages API's
    routes Anthropic's (`{"type": "error", "error": {"type", "message"}}`)."""
    if not (path.startswith(MESSAGES_PATH) and isinstance(response, JSONResponse)):
        return response
    error = json.loads(response.body)["error"]
    body = {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(response.status_code, "api_error"),
                                       "message": error["message"]}}
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(body, status_code=response.status_code, headers=headers)


LLM_RETRY_AFTER_S = 5  # what a request refused while the LLM is away is told (Retry-After): the probe's pace


LLM_AWAY = "the LLM is unavailable at the moment; retry later (requests with r2r_policy 'slm' still run)"


def llm_away() -> APIError:
    """A request that needs a remote LLM which is away: 503, and when to try again."""
    return APIError(503, LLM_AWAY, code="llm_unavailable", kind="server_error",
                    headers={"Retry-After": str(LLM_RETRY_AFTER_S)})


def type_label(part) -> bool:
    """Whether a part of an error's location names a type pydantic tried (a union's member), not a field."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


async def validation_error(http: HTTPRequest, e: RequestValidationError) -> JSONResponse:
    """FastAPI's body validation, as an OpenAI-style 400 naming the bad field: of a value that matches no member of
    a union (text or a list of parts, say), the failure that went deepest into it, which is the one the client
    meant; where several went as deep, the one of the member with the fewest failures (token ids with one negative
    id are a list of ids with one bad id, not a list of texts with no text in it), and then a bad value (too short,
    out of range) before a value of the wrong type."""
    errors = e.errors()

    def member(error) -> tuple:  # the union member a failure is of: its location up to the first type tried
        loc = error["loc"]
        return loc[:next((i + 1 for i, part in enumerate(loc) if type_label(part)), len(loc))]

    failures = Counter(member(error) for error in errors)
    first = max(errors, key=lambda error: (sum(not type_label(x) for x in error["loc"]), -failures[member(error)],
                                           not error["type"].endswith("_type")))
    loc = [str(x) for x in first["loc"] if x != "body" and not type_label(x)]
    param = ".".join(loc) if loc and first["type"] != "json_invalid" else None
    if first["type"] == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
    elif not loc:
        message = "the request body must be a JSON object (sent with content-type: application/json)"
    else:
        message = f"{param}: {first['msg']}"
    return APIError(400, message, param=param).response()
