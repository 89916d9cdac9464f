"""The one error type the server raises for anything a client should see as an HTTP status."""


class CaptureError(Exception):
    """`status` is the HTTP code; `param` names the offending request field when there is one."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
