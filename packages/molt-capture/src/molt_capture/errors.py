"""Errors a client should see as an HTTP status, and the one a generator raises to refuse."""

MAX_REQUEST_BYTES = 32 * 2**20  # Anthropic's documented limit for a Messages request; over: 413


class CaptureError(Exception):
    """`status` is the HTTP code; `param` names the offending request field when there is one."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class ParamRejected(Exception):
    """Raised by a generator when the engine refuses a `SamplingParams` field (`param`): the
    client's fault, so it gets a 400 naming the field in its wire's terms, not a 5xx to retry."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message
