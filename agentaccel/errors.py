"""OpenAI-style errors: every failure the proxy reports is `{"error": {message, type, param, code}}`.
Backends raise them too (an upstream down is a 502 whoever notices it)."""

from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def upstream_unavailable(message: str) -> APIError:
    return APIError(502, message, type="upstream_error", code="upstream_unavailable")


def upstream_timeout(message: str) -> APIError:
    return APIError(504, message, type="upstream_error", code="upstream_timeout")
