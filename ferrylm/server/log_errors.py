"""Lost log lines. When a log handler's stream fails (a full disk, a closed pipe, /dev/full), logging calls
`Handler.handleError`, whose default prints a traceback to that same broken stream and so says nothing. The
serve process counts them instead and reports them where they can still be read: `/health` gains
`log_write_errors` and a warning, `/metrics` has `ferry:log_write_errors`. Serving goes on.
"""

from __future__ import annotations

import logging

lost = 0
"""Log records that could not be written since `install()`."""


def install() -> None:
    def handle_error(self, record):
        global lost
        lost += 1

    logging.Handler.handleError = handle_error
