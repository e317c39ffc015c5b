"""The one exception type users see.

Anything raised as `MinervaError` is a problem with the user's input (a file, a
name, a flag, a prompt). Entry points print its message on one line and exit
non-zero; everything else is a bug and keeps its traceback. The helpers below word the
errors of what several commands share: MINERVA_HOME, and the files they write their results to.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

HOME_ADVICE = "set MINERVA_HOME to a writable folder"


class MinervaError(Exception):
    """A user-facing error: the message names the input and what to do; `field`, where it is
    about one field of a request, names it (the server's error `param`)."""

    def __init__(self, message: str = "", field: str | None = None):
        super().__init__(message)
        self.field = field


def not_a_file(path) -> str:
    """Why `path` is no regular file, in words that follow its name: 'does not exist', 'is a
    named pipe, not a file', 'is a symbolic link that points to itself (in a loop)', ..."""
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


def _home_name() -> str:
    home = os.environ.get("MINERVA_HOME")
    return f"MINERVA_HOME '{home}'" if home else "the default MINERVA_HOME (~/.cache/minerva)"


def minerva_home() -> Path:
    """MINERVA_HOME, else ~/.cache/minerva: the root of the model store and the kernel cache."""
    home = os.environ.get("MINERVA_HOME")
    try:
        return Path(home).expanduser() if home else Path.home() / ".cache" / "minerva"
    except RuntimeError as exc:  # `~user` of no such user, or no home directory to be found
        raise MinervaError(f"{_home_name()} cannot be used ({exc}); {HOME_ADVICE}") from None


def home_folder(name: str, what: str) -> Path:
    """`minerva_home() / name` (`what` in words: 'the model store'), not made; MINERVA_HOME or
    that folder being a file (or anything but a folder) is said at once, not as a traceback later."""
    base = minerva_home()
    for folder in (base, base / name):  # a file in the way
        if os.path.lexists(folder) and not folder.is_dir():
            where = _home_name() if folder == base else f"{what} '{folder}'"
            why = "is a file, not a folder" if folder.is_file() else not_a_file(folder)
            raise MinervaError(f"{where} {why}; point MINERVA_HOME at a folder (or move what is there)")
    return base / name


def make_home_folder(folder: Path) -> Path:
    """Make `folder` under MINERVA_HOME (and its parents) where missing; one that cannot be made
    (a read-only or virtual file system, a file in the way) is an error naming MINERVA_HOME."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        # the outermost folder that is missing: the one that could not be made
        failed = next((f for f in reversed([folder, *folder.parents]) if not os.path.lexists(f)), folder)
        what = (_home_name() if failed == minerva_home() else f"{_home_name()} cannot be used: '{failed}'")
        raise MinervaError(f"{what} cannot be created ({exc.strerror or exc}); {HOME_ADVICE}") from None
    return folder


def _cannot_write(option: str, path, exc: OSError) -> str:
    parent = Path(path).expanduser().parent
    if exc.errno in (errno.ENOENT, errno.ENOTDIR) and not parent.is_dir():
        why = f"'{parent}' is not a folder" if os.path.lexists(parent) else f"its folder '{parent}' does not exist"
    else:
        why = exc.strerror or str(exc)
    return f"{option} '{path}' cannot be written ({why})"


def make_output_folder(folder: Path, option: str) -> None:
    """Make the folder a command writes into (`option` names it), or say why it cannot be."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MinervaError(f"{option}: the folder '{folder}' cannot be created ({exc.strerror or exc}); give a path "
                           "in a folder you can write to") from None


def output_file(path, option: str) -> Path:
    """`path`, where a command writes its results once its work is done, checked before the work
    starts, so that a long run's results are not lost at its end: not a folder, in a folder that
    exists, writable (tried: a file made only to try is removed). Else an error naming `option`."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise MinervaError(f"{option} '{path}' is a directory; give a file name (in it, or elsewhere)")
    existed = os.path.lexists(p)
    try:
        os.close(os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644))
    except OSError as exc:
        raise MinervaError(f"{_cannot_write(option, path, exc)}; give a path in a folder you can write to") from None
    if not existed:
        p.unlink(missing_ok=True)
    return p


def write_output(path, text: str, option: str) -> None:
    """Write a command's results to `path` (checked by `output_file` before the work); should it
    fail now (a full disk, a folder gone), they go to a temporary file instead, and the error
    says where, so the run is not lost."""
    try:
        Path(path).expanduser().write_text(text)
        return
    except OSError as exc:
        message = _cannot_write(option, path, exc)
    try:
        fd, kept = tempfile.mkstemp(prefix="minerva-", suffix=Path(path).suffix or ".txt")
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except OSError as exc:
        raise MinervaError(f"{message}, nor could the results be kept in a temporary file ({exc.strerror or exc})") from None
    raise MinervaError(f"{message}; the results are kept in {kept} instead")
