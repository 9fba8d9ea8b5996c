"""Files written whole or not at all: the profile, calibration cache and `ferry doctor --write-fixes` writers."""

from __future__ import annotations

import contextlib
import os
import secrets


def write_atomic(path: str, text: str) -> None:
    """`text` to a temporary file beside `path`, synced, renamed over it: a reader or a crash sees the old file or
    the whole new one, and no temporary file is left behind if a step fails (an interrupt too). The file gets the
    mode a plain `open(path, "w")` would: created 0666 and the kernel applies the umask (no process-wide umask
    change, which would race other threads' files). Raises `OSError`."""
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
