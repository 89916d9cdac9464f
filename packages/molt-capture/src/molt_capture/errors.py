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
    """Raised by a generator when the engine refuses a request parameter (a stop string it
    cannot handle, a temperature out of its range): the client's fault, so the client gets a
    400 naming the parameter in its wire's terms, not a 5xx its SDK would retry.
    `param` is the `SamplingParams` field ("stop", "temperature", "top_p", "max_tokens")."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message
