"""Progress of a long staging run, readable on a terminal and in a log file."""
import sys
import time

TTY_REFRESH = 0.2        # seconds between rewrites of the `\r` line on a terminal
LOG_INTERVAL = 5.0       # seconds between lines when the output is a file or a pipe


class Progress:
    """Reports tensors and bytes staged so far.

    On a terminal: one line rewritten in place (`\\r`), a newline at the end.
    Elsewhere (redirected to a file, a pipe, a journal): a whole line every
    `interval` seconds, flushed at once, so a log shows the work going on
    while it runs; then a last line at the end. `tty=None` asks the stream.
    """

    def __init__(self, total_bytes=None, total_tensors=None, *, stream=None, interval=None, tty=None,
                 label="prefetchd stage"):
        self.stream = stream if stream is not None else sys.stderr
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty and isatty())
        self.tty = tty
        self.interval = (TTY_REFRESH if tty else LOG_INTERVAL) if interval is None else float(interval)
        self.total_bytes, self.total_tensors, self.label = total_bytes, total_tensors, label
        self.tensors = self.nbytes = 0
        self.started = self._last = time.monotonic()
        self._shown = False

    def line(self):
        elapsed = max(time.monotonic() - self.started, 1e-9)
        of_t = f"/{self.total_tensors}" if self.total_tensors else ""
        of_b = f"/{self.total_bytes / 2**20:.1f}" if self.total_bytes else ""
        pct = f" ({100 * self.nbytes / self.total_bytes:.0f}%)" if self.total_bytes else ""
        return (f"{self.label}: {self.tensors}{of_t} tensors, {self.nbytes / 2**20:.1f}{of_b} MiB{pct}, "
                f"{self.nbytes / elapsed / 1e6:.0f} MB/s, {elapsed:.1f} s")

    def update(self, tensors, nbytes):
        """Record the running totals; print if the interval has passed."""
        self.tensors, self.nbytes = tensors, nbytes
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self._emit()

    def finish(self):
        """The last line (and the newline ending the `\\r` line on a terminal)."""
        self._emit()
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _emit(self):
        if self.tty:
            self.stream.write("\r" + self.line() + "\x1b[K")
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()
        self._shown = True
