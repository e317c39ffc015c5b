"""The one exception type users see.

Anything raised as `MinervaError` is a problem with the user's input (a file, a
name, a flag, a prompt). Entry points print its message on one line and exit
non-zero; everything else is a bug and keeps its traceback.
"""


class MinervaError(Exception):
    """A user-facing error: the message names the input and what to do."""
