"""Start-up phases: what a starting process is doing, logged as it happens.

    with startup_phase("loading weights", "SmolLM2-135M-Instruct"):
        ...

logs `loading weights (SmolLM2-135M-Instruct) ...` when the phase begins and `loading weights:
done in 2.3 s` when it ends (or `... failed after`). On a terminal, a phase that runs longer than
PROGRESS_AFTER_S also shows a live line on stderr (elapsed time, and the share of the estimate
when the phase has one), erased when the phase ends; anywhere else (a pod's log, a file, a pipe)
only the plain lines are written. With `phase=` (one of startup_times.PHASES) the duration is
also added to the process's StartupTimes, read by /metrics and the readiness line.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO

from kvmesh.common.startup_times import get_startup_times

logger = logging.getLogger("kvmesh.startup")

PROGRESS_AFTER_S = 3.0       # a shorter phase shows no live line
_REDRAW_S = 0.5
_BAR = 20                    # characters of the bar when the phase has an estimate


def progress_line(name: str, elapsed_s: float, estimate_s: float | None) -> str:
    """The live line: `name  12 s` or, with an estimate, `name [#####...]  12 s of ~60 s`."""
    if not estimate_s:
        return f"{name} ... {elapsed_s:.0f} s"
    filled = min(_BAR - 1, int(_BAR * elapsed_s / estimate_s))
    bar = "#" * filled + "." * (_BAR - filled)
    return f"{name} [{bar}] {elapsed_s:.0f} s of ~{estimate_s:.0f} s"


class _Progress:
    """The live line on a terminal, redrawn by a daemon thread until stop()."""

    def __init__(self, name: str, estimate_s: float | None, stream: TextIO) -> None:
        self.name, self.estimate_s, self.stream = name, estimate_s, stream
        self.t0 = time.monotonic()
        self.drawn = False
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kvmesh-progress", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self.done.wait(PROGRESS_AFTER_S):
            return
        while not self.done.is_set():
            line = progress_line(self.name, time.monotonic() - self.t0, self.estimate_s)
            self._write(f"\r\x1b[2K{line}")
            self.drawn = True
            self.done.wait(_REDRAW_S)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        if self.drawn:
            self._write("\r\x1b[2K")          # erase it: the log line that follows says it all

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):         # a closed terminal must not fail the start-up
            pass


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@contextmanager
def startup_phase(name: str, detail: str = "", estimate_s: float | None = None,
                  stream: TextIO | None = None, phase: str | None = None,
                  clock: Callable[[], float] = time.monotonic) -> Iterator[None]:
    """Log the phase `name` as it begins and ends, with its duration; `detail` says what it works
    on, `estimate_s` how long it usually takes (shown on the terminal's live line), `phase` the
    StartupTimes phase its duration counts in (None: none)."""
    stream = sys.stderr if stream is None else stream
    times = get_startup_times() if phase is not None else None
    if times is not None:
        times.begin(phase)
    logger.info("%s%s ...", name, f" ({detail})" if detail else "")
    t0 = clock()
    progress = _Progress(name, estimate_s, stream) if _is_terminal(stream) else None
    try:
        yield
    except BaseException:
        if progress is not None:
            progress.stop()
        elapsed = clock() - t0
        if times is not None:
            times.end(phase, elapsed)
        logger.info("%s: failed after %.1f s", name, elapsed)
        raise
    if progress is not None:
        progress.stop()
    elapsed = clock() - t0
    if times is not None:
        times.end(phase, elapsed)
    logger.info("%s: done in %.1f s", name, elapsed)
