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


class EngineDeadError(RuntimeError):
    """The engine loop has died; every request in flight fails with this."""
