"""Files written whole or not at all: the profile, calibration cache and `ferry doctor --write-fixes` writers."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat

from ferrylm.errors import FerryError


def writable_target(flag: str, path: str, example: str) -> str:
    """`flag path` (a file a command will write) as an absolute path, or a `FerryError` saying why it cannot be
    written: no name, a folder or something else that is no regular file (a device, a pipe: renamed over, /dev/full
    became a file), its folder missing or not writable. A symbolic link names its target, which is replaced; the
    link stays. `example`: a file name the messages suggest."""
    if not path.strip():
        raise FerryError(f"{flag} '': name a file, e.g. {example}")
    try:
        mode = os.stat(path).st_mode  # through links: /dev/stdout is the pipe or terminal it names
    except OSError:
        mode = None
    p = os.path.realpath(path)
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise FerryError(f"{flag} {path}: is not a regular file (a device or a pipe), which the write would replace; "
                         f"name a file, e.g. {example}")
    if os.path.isdir(p):
        raise FerryError(f"{flag} {path}: is a directory; name a file, e.g. {os.path.join(path, example)}")
    folder = os.path.dirname(p)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise FerryError(f"{flag} {path}: directory {folder} does not exist or is not writable")
    return p


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
