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


def not_a_file(path) -> str:
    """Why `path` is no regular file, in words that follow its name: 'does not exist', 'is a
    named pipe, not a file', 'is a symbolic link that points to itself (in a loop)', ..."""
    import errno
    import os
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "is a symbolic link to nothing (its target does not exist)" if os.path.islink(path) else "does not exist"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symbolic link that leads back to itself (a loop)"
        return f"cannot be looked up ({exc.strerror or exc})"
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return f"is {what}, not a file"
    return "is not a regular file"
