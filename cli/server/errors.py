"""Errors of `specrun serve`, in OpenAI's shape: {"error": {"message", "type", "code"}}; under
/v1/messages in Anthropic's: {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

ANTHROPIC_PATH = "/v1/messages"    # its errors (and /v1/messages/count_tokens') are in Anthropic's shape

# pydantic error types (schemas.py) whose name is the error code answered
_OWN_CODES = ("unencodable_text", "unsupported_parameter")


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
             403: "permission_error", 501: "not_supported_error", 503: "unavailable_error"}

    def __init__(self, status: int, message: str, code: str, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers

    # Anthropic's error types (https://docs.anthropic.com/en/api/errors)
    ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                       404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                       503: "overloaded_error"}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "code": self.code}}

    def anthropic_body(self) -> dict:
        """The error in Anthropic's shape (/v1/messages): {"type": "error", "error": {"type", "message"}}."""
        return {"type": "error", "error": {"type": self.ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": self.message, "code": self.code}}

    def response(self, path: str = "") -> JSONResponse:
        """The answer to a request for path (Anthropic's shape under ANTHROPIC_PATH)."""
        anthropic = path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")
        return JSONResponse(self.anthropic_body() if anthropic else self.body(), status_code=self.status,
                            headers=self.headers)


class ClientGone(Exception):
    """The client closed the connection before its request got a slot: nobody to answer."""


def validation_message(exc: RequestValidationError) -> tuple[str, str]:
    """FastAPI's validation errors -> one message naming the fields, and an error code."""
    errors = exc.errors()
    own = [e for e in errors if e["type"] in _OWN_CODES]   # a union's other branches would only add noise
    if own:
        errors = own[:1]
    parts: list[str] = []
    code = "invalid_value"
    for err in errors:
        if err["type"] == "json_invalid":
            ctx = err.get("ctx", {}).get("error", "")
            return f"the request body is not valid JSON ({ctx})", "invalid_json"
        if tuple(err["loc"]) == ("body",) and isinstance(err.get("input"), bytes | str):
            return ("the request body must be a JSON object, sent with 'Content-Type: application/json'",
                    "invalid_json")
        loc = [str(x) for x in err["loc"][1:] if not (isinstance(x, str) and ("[" in x or x in ("str", "int")))]
        where = ".".join(loc) or "body"
        if err["type"] == "missing":
            code = "missing_field"
        elif err["type"] in _OWN_CODES:
            code = err["type"]
        # a check of the whole body (logprobs with stream...) names its fields in its own words
        line = err["msg"] if where == "body" and err["type"] in _OWN_CODES else f"{where}: {err['msg']}"
        if line not in parts:
            parts.append(line)
    more = f" (and {len(parts) - 3} more)" if len(parts) > 3 else ""
    return "; ".join(parts[:3]) + more, code
