"""The one exception type users see.

Anything raised as `MinervaError` is a problem with the user's input (a file, a
name, a flag, a prompt). Entry points print its message on one line and exit
non-zero; everything else is a bug and keeps its traceback.
"""


class MinervaError(Exception):
    """A user-facing error: the message names the input and what to do; `field`, where it is
    about one field of a request, names it (the server's error `param`)."""

    def __init__(self, message: str = "", field: str | None = None):
        super().__init__(message)
        self.field = field
