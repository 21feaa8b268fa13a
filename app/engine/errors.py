"""Errors the engine raises across its API boundary."""


class InvalidRequestError(ValueError):
    """A request the engine refuses; `field` names the offending input, the message its limit."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status = status  # the HTTP status the serving layer answers with (403: a forbidden path)

    def __reduce__(self):  # crosses Ray process boundaries intact
        return type(self), (self.field, self.message, self.status)


class AdapterNotLoadedError(InvalidRequestError):
    """A request named an adapter the engine does not hold (never loaded, or evicted since its load):
    the serving layer may load it again and resubmit."""


class EngineDeadError(RuntimeError):
    """The engine loop has died; every request in flight fails with this."""


class EngineStepError(RuntimeError):
    """A step computing this request failed; the request was dropped (its KV freed), the engine
    goes on. The message says so in one sentence; the engine's log has the traceback."""


class BackendError(RuntimeError):
    """A production backend (TensorRT-LLM, Triton) failed a request; the message is the backend's own."""

    def __init__(self, backend: str, message: str, status: int = 502):
        super().__init__(f"{backend}: {message}")
        self.backend = backend
        self.message = message
        self.status = status

    def __reduce__(self):
        return type(self), (self.backend, self.message, self.status)
