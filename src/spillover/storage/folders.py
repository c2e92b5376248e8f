"""Whether a local folder can take files, checked before work that would write there
fails after minutes (the CLI's folder options, the REST API's savepoint targets)."""

from __future__ import annotations

import errno
import os
import tempfile

from spillover.errors import ConfigError


def check_folder(named: str, folder: str, *, create: bool = True) -> None:
    """Checks ``folder`` takes a file, creating it (unless ``create`` is false: then
    the nearest folder that exists must let it be made): a ConfigError (bad usage,
    exit 2) naming the option ``named`` now, not a failure after minutes of runs."""
    try:
        if create:
            os.makedirs(folder, exist_ok=True)
        existing = os.path.abspath(folder)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", existing)
        if existing != os.path.abspath(folder):
            if not os.access(existing, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "cannot create folders in", existing)
            return
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".spillover-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(
            f"cannot write the folder of {named}",
            detail=f"{folder!r}: {type(e).__name__}: {e.strerror or e}",
            hint="give a folder you can write",
        ) from None
