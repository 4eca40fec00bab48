"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.

400 a bad field (malformed JSON, a value out of range, a prompt over the context), 401 a missing or wrong API key,
404 an unknown model or route, 413 a body over the server's limit (`body_limit`), 503 a full queue or a server
shutting down, 500 only for a failure of the server itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # fastapi only where a response is made: the engine imports this module for its shutdown message
    from fastapi.responses import JSONResponse

SHUTTING_DOWN = "shutting_down"  # the code of a request that the server's shutdown refused or ended (503), both servers
SHUTTING_DOWN_MESSAGE = "the server is shutting down; send the request again"  # a new request's, both servers
MAX_REQUEST_BYTES = 16 * 2**20  # the largest request body `ats serve` accepts by default (--max-request-bytes)
TOO_LARGE = "request_too_large"  # the code of a body over that limit (413), both servers


class APIError(Exception):
    """An error to answer with `status` and OpenAI's error body.

    Args:
        status: the HTTP status.
        message: the error's message.
        param: the request field at fault, or None.
        code: OpenAI's error code (e.g. "invalid_api_key"), or None.
        type: OpenAI's error type; default: "invalid_request_error" below 500, else "server_error".
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        """OpenAI's error body: a response's, or a stream's last event's data."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The JSON response: OpenAI's error body with `status` (and `WWW-Authenticate` on a 401)."""
        from fastapi.responses import JSONResponse

        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def shutdown_error(message: str) -> APIError:
    """The 503 of a request that the server's shutdown refused or ended (code `SHUTTING_DOWN`; clients retry it)."""
    return APIError(503, message, code=SHUTTING_DOWN)


_NOT_AN_OBJECT = frozenset({"missing", "model_attributes_type", "model_type", "dict_type"})
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _field_path(loc) -> list[str]:
    """A pydantic error location as the request's field path: "body" and the union members' tags (e.g. "str",
    "list[str]") left out."""
    return [str(part) for part in loc if part != "body" and not (
        isinstance(part, str) and (part in _TYPE_NAMES or "[" in part or part.startswith("function-")))]


def validation_error(errors: list[dict]) -> APIError:
    """400 from pydantic / FastAPI validation errors, naming the first bad field and its value.

    Of a union's errors (one per member the value failed), the deepest is named: a list whose item is bad says
    which item, rather than that the list is not a string.

    Args:
        errors: the validation errors, as `ValidationError.errors()` lists them.

    Returns:
        The 400 error (code "invalid_json" for a body that is not JSON).
    """
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"could not parse the JSON body of the request: {detail}".rstrip(": "),
                        code="invalid_json")
    ctx = first.get("ctx") or {}
    if "param" in ctx:  # the schemas' own errors name their field (`schemas.APIRequest`)
        return APIError(400, str(first.get("msg")), param=str(ctx["param"]))
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") in _NOT_AN_OBJECT:  # empty, or not an object
        if first.get("input") is None:
            return APIError(400, "the request has no body: send a JSON object", code="invalid_json")
        return APIError(400, f"the request body must be a JSON object, got {type(first.get('input')).__name__}",
                        code="invalid_json")
    field = _field_path(first.get("loc", ()))[:1]
    first = max((e for e in errors if _field_path(e.get("loc", ()))[:1] == field),
                key=lambda e: len(_field_path(e.get("loc", ()))))
    loc = _field_path(first.get("loc", ()))
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if loc and "input" in first and first.get("type") != "missing":
        value = repr(first["input"])
        message += f" (got {value if len(value) <= 80 else value[:77] + '...'})"
    return APIError(400, f"{param}: {message}" if param else message, param=param)
