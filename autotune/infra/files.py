"""Who may read what autotune writes: on a shared box, trial data stays its owner's.

The study database, ``best.json``, ``report.html`` and the logs hold a workload's names, its
losses and timings, and the storage URL. So files autotune creates are ``0600`` and folders
``0700`` by default, whatever the shell's umask: autotune applies the umask ``077`` to what
it creates (the command line sets it for the whole command, its workers included; the library
passes the modes explicitly where it writes).

``AUTOTUNE_UMASK`` (octal) sets another umask for operators who want outputs shared:
``AUTOTUNE_UMASK=022`` gives ``0644`` files and ``0755`` folders, readable by everyone on the
box; ``027`` shares them with the group. Files that exist already keep their mode.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from autotune.errors import SpecError

__all__ = [
    "DEFAULT_UMASK",
    "UMASK_ENV",
    "create_file",
    "dir_mode",
    "file_mode",
    "make_dirs",
    "open_for_writing",
    "output_umask",
    "umask_applied",
    "write_text",
]

UMASK_ENV = "AUTOTUNE_UMASK"
# Owner only: trial data and a storage URL are nobody else's business on a shared box.
DEFAULT_UMASK = 0o077


def output_umask() -> int:
    """The umask for what autotune creates: ``AUTOTUNE_UMASK`` (octal), else ``077``.

    Raises:
        SpecError: the variable is not an octal umask, naming it, its value and the fix.

    Example:
        >>> os.environ["AUTOTUNE_UMASK"] = "022"
        >>> oct(output_umask()), oct(file_mode()), oct(dir_mode())
        ('0o22', '0o644', '0o755')
        >>> del os.environ["AUTOTUNE_UMASK"]
    """
    text = os.environ.get(UMASK_ENV, "").strip()
    if not text:
        return DEFAULT_UMASK
    try:
        value = int(text.removeprefix("0o"), 8)
    except ValueError:
        value = -1
    if not 0 <= value <= 0o777:
        raise SpecError(
            f"{UMASK_ENV} must be an octal umask from 000 to 777, got {UMASK_ENV}={text!r}; "
            "e.g. 077 (files only you can read, the default) or 022 (readable by everyone)"
        )
    return value


def file_mode() -> int:
    """The mode a new file gets: ``0600`` under the default umask."""
    return 0o666 & ~output_umask()


def dir_mode() -> int:
    """The mode a new folder gets: ``0700`` under the default umask."""
    return 0o777 & ~output_umask()


def make_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents, each with :func:`dir_mode` (``mkdir -p``).

    ``Path.mkdir(parents=True, mode=...)`` gives the mode to the last folder only.
    """
    path = Path(path)
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    mode = dir_mode()
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            folder.mkdir(mode=mode)


def open_for_writing(path: Path, mode: str = "w", encoding: str = "utf-8") -> IO[Any]:
    """``open(path, mode)`` for ``w`` or ``a``, a new file created with :func:`file_mode`."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode.startswith("a") else os.O_TRUNC)
    fd = os.open(path, flags, file_mode())
    return os.fdopen(fd, mode, encoding=encoding)


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (UTF-8), a new file created with :func:`file_mode`."""
    with open_for_writing(path) as f:
        f.write(text)


def create_file(path: Path) -> bool:
    """Create an empty file with :func:`file_mode` unless it exists; True when created.

    SQLite creates its database ``0644`` (less the umask); created here first, the database
    and its journals (which copy its mode) are the owner's.
    """
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, file_mode()))
    except FileExistsError:
        return False
    return True


@contextlib.contextmanager
def umask_applied() -> Iterator[int]:
    """Set the process's umask to :func:`output_umask` inside the block, then restore it.

    For a whole command (what its workers and libraries create too); not for a thread of a
    program that goes on doing other things, as a umask is the whole process's.

    Raises:
        SpecError: ``AUTOTUNE_UMASK`` is malformed (before anything is changed).
    """
    mask = output_umask()
    previous = os.umask(mask)
    try:
        yield mask
    finally:
        os.umask(previous)
