"""The one exception type for errors a user can cause; the CLI prints its message, not a traceback."""


class ForerunError(Exception):
    """Bad input or a missing resource: the message says what was wrong and what to do."""
