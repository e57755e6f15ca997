"""The error a request is answered with: an OpenAI error body naming the field it is about."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error answered as an OpenAI error body: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
                             503: "service_unavailable"}.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param=param, code="invalid_value")
