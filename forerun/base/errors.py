"""The exception type for errors a user can cause (the CLI prints its message, not a traceback), and
its kind that names the setting at fault."""


class ForerunError(Exception):
    """Bad input or a missing resource: the message says what was wrong and what to do."""


class FieldError(ForerunError):
    """A setting's value refused; `field` names the setting (the server's 400 points at it)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
