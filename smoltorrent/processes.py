"""Whether a process is still there, by its pid: a holder of a lease, a lock or a file
that died (SIGKILL, the OOM killer) is known dead only this way."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """Whether process `pid` exists; one of another user's (kill(2) refused) counts."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
