"""The way out of a rank that must end: its one line written without blocking, and a timer, started before it is
needed, that ends the process whatever the line's write or anything else on the way out does.

Why: the way out must not depend on a write succeeding. stderr may be a pipe whose reader is gone (a plain
``print`` raises BrokenPipeError: on the host watchdog's thread that killed the thread and left the rank running)
or a pipe nobody drains (the write blocks for ever, on the main thread or the watchdog's). So:

- `write_line` writes the line on a file description of its own, opened non-blocking (``/proc/self/fd/2``
  reopened: a pipe's or a terminal's flags are shared with every process that inherited it, torchrun's agent
  and the other ranks, so ``fcntl`` on fd 2 itself would change theirs), at most ``LINE_WAIT_S`` waiting for
  room, and says whether the whole line went out; a pipe nobody reads any more is seen at the open (``ENXIO``)
  or the write (``EPIPE``), and given up at once;
- `flush_streams` flushes Python's own buffers of stdout and stderr on a thread of its own, waited for at most
  ``FLUSH_WAIT_S`` (a flush into a full pipe blocks in ``write``; the thread is left behind);
- `arm` sets the exit timer: a daemon thread that `prepare` started before any exit path can begin (the host
  watchdog's start), which ends the process with ``os._exit(code)`` once the armed time has passed, whatever
  the path is doing. It is a Python thread: it needs the interpreter's lock, which a call that never releases it
  holds (a non-member's subgroup split on NCCL); that case is the host watchdog's sidecar process's
  (train/watchdog_sidecar.py).

Only the standard library: the sidecar process imports this module too, without torch.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import select
import stat
import sys
import threading
import time

LINE_WAIT_S = 2.0
"""How long the line may wait for room in a full pipe (a reader that is slow but alive drains it well within)."""
FLUSH_WAIT_S = 1.0
"""How long the way out waits for Python's stdout and stderr buffers to be flushed before its own line."""


def write_line(line: str, fd: int = 2, within_s: float = LINE_WAIT_S) -> bool:
    """Write ``line`` (a newline added) to ``fd`` without ever blocking past ``within_s``; True when all of it
    went out. Never raises: a closed descriptor, a pipe with no reader, a full one that stays full are each a
    False (module docstring)."""
    data = memoryview((line.rstrip("\n") + "\n").encode("utf-8", "backslashreplace"))
    deadline = time.monotonic() + within_s
    try:
        mode = os.fstat(fd).st_mode
    except OSError:  # fd 2 closed
        return False
    if stat.S_ISSOCK(mode):  # a socket (a journal's stream): sent with MSG_DONTWAIT, its flags untouched
        return _send(fd, data, deadline)
    target, own = fd, False
    if not stat.S_ISREG(mode):  # a pipe, a FIFO, a terminal: a description of our own, non-blocking
        try:
            target = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
            own = True
        except OSError as err:
            if err.errno == errno.ENXIO:  # a pipe or FIFO whose every reader has gone
                return False
            # no /proc: fd itself, each chunk written only once poll() says a pipe's atomic chunk fits
    try:
        while data:
            if not own and not stat.S_ISREG(mode) and not _writable(target, deadline):
                return False
            try:
                data = data[os.write(target, data[: select.PIPE_BUF] if not own else data) :]
            except BlockingIOError:
                if not _writable(target, deadline):
                    return False
        return True
    except OSError:  # EPIPE (the reader left meanwhile), EIO, ...
        return False
    finally:
        if own:
            os.close(target)


def _writable(fd: int, deadline: float) -> bool:
    """Whether ``fd`` has room before ``deadline`` (and a reader: POLLERR/POLLHUP say it has none)."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    while (left := deadline - time.monotonic()) > 0:
        with contextlib.suppress(InterruptedError):
            for _, events in poller.poll(max(1, math.ceil(left * 1000))):
                return bool(events & select.POLLOUT) and not events & (select.POLLERR | select.POLLHUP)
    return False


def _send(fd: int, data: memoryview, deadline: float) -> bool:
    import socket

    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            while data:
                try:
                    data = data[sock.send(data, socket.MSG_DONTWAIT) :]
                except BlockingIOError:
                    if not _writable(sock.fileno(), deadline):
                        return False
        return True
    except OSError:
        return False


def flush_streams(within_s: float = FLUSH_WAIT_S) -> None:
    """Flush Python's stdout and stderr buffers, waiting at most ``within_s`` (a flush into a full pipe blocks:
    its thread is left behind, holding only that stream)."""

    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()

    flushing = threading.Thread(target=flush, name="exit-flush", daemon=True)
    flushing.start()
    flushing.join(within_s)


class _ExitTimer:
    """The daemon thread behind `arm`: sleeps until the earliest armed time, then ``os._exit``."""

    def __init__(self):
        self.at, self.code = math.inf, 3
        self.changed = threading.Event()
        self.thread = threading.Thread(target=self._run, name="exit-timer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            left = self.at - time.monotonic()
            if left <= 0:
                os._exit(self.code)
            self.changed.wait(min(left, 3600.0))
            self.changed.clear()

    def arm(self, code: int, within_s: float) -> None:
        at = time.monotonic() + within_s
        if at < self.at:
            self.code, self.at = code, at
            self.changed.set()


_timer: dict[str, _ExitTimer | None] = {"it": None}


def prepare() -> None:
    """Start this process's exit timer (once; again in a forked child, whose copy of the thread does not run), so
    that it exists before any way out begins."""
    timer = _timer["it"]
    if timer is None or not timer.thread.is_alive():
        _timer["it"] = _ExitTimer()


def arm(code: int, within_s: float) -> None:
    """End the process with ``code`` ``within_s`` seconds from now, whatever happens meanwhile (an earlier armed
    time stays: arming never postpones)."""
    prepare()  # started by the host watchdog's start; here only where no watchdog ever ran
    _timer["it"].arm(code, within_s)
