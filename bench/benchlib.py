"""What several benches share: running a ``tensegrity`` command in this process with its console output kept."""
from __future__ import annotations

import contextlib
import io
import time
from typing import Sequence, Tuple


def run_cli(argv: Sequence[str], *, show_progress: bool = True) -> Tuple[int, float, str]:
    """``tensegrity ARGV`` in this process: (exit code, wall seconds, its standard output). Progress bars (standard
    error) still reach the terminal unless ``show_progress`` is False."""
    from tensegrity_ros.cli import main as cli

    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.redirect_stdout(buf))
        if not show_progress:
            stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
        rc = cli(list(argv))
    return rc, time.perf_counter() - t0, buf.getvalue()
