"""Request bodies parsed and validated off the event loop. The time a body takes to validate grows with the objects
it holds (messages, parts, tools), and on the loop it would hold up every stream: so a route's body is read in the
tokenizer's lanes (guard.Tokenizing: bodies of a few objects in one, those of many in the other, at most
--max-tokenizing of them at once), and the route declares it for /openapi.json itself (`documented`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

from roads_to_rome.serving.state import server

Body = TypeVar("Body", bound=BaseModel)
Result = TypeVar("Result")
COMPONENTS = "#/components/schemas/{model}"
# A body validates in time that grows with the objects in it (messages, parts, tools, items), not with its bytes (a
# long text is one string): this many or fewer take milliseconds, and share the short prompts' lane.
MANY_OBJECTS = 2048


def validated(model: type[Body], body: Any) -> Body:
    """`body` as `model`, or the 400 FastAPI's own validation gives (serving/errors.validation_error)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError([{**error, "loc": ("body", *error["loc"])} for error in e.errors()]) from None


def parsed(model: type[Body], raw: bytes) -> Body:
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise not_json(e.msg) from None
    except UnicodeDecodeError as e:
        raise not_json(f"it is not UTF-8 text ({e})") from None
    except RecursionError:
        raise not_json("it nests too deeply") from None
    return validated(model, body)


def not_json(why: str) -> RequestValidationError:
    """The 400 FastAPI gives a body that is not JSON (serving/errors.validation_error says `why`)."""
    return RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error", "input": {},
                                    "ctx": {"error": why}}])


async def off_loop(http: HTTPRequest, work: Callable[..., Result], *args) -> Result:
    """`work(*args)`, whose time grows with the objects in the request's body, in the lane for as many."""
    objects = (await http.body()).count(b"{")  # (braces in strings too: an upper bound)
    return await server(http).tokenizing.run(objects > MANY_OBJECTS, work, *args)


def body_of(model: type[Body]) -> Callable[[HTTPRequest], Coroutine[Any, Any, Body]]:
    """A dependency giving the request's body as `model`, parsed and validated in the lanes."""
    async def read(http: HTTPRequest) -> Body:
        return await off_loop(http, parsed, model, await http.body())

    return read


def documented(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra`: its body is `model` (whose schema `with_body_schemas` adds to the components)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": COMPONENTS.format(model=model.__name__)}}}}}


def with_body_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """/openapi.json gives each body's schema, as FastAPI would for a body it validated itself."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()
            _, defs = models_json_schema([(model, "validation") for model in models], ref_template=COMPONENTS)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        return app.openapi_schema

    app.openapi = openapi
