"""The ranks' output: each rank's stdout and stderr split into whole lines, prefixed
with the rank and written to the launcher's own (a line is never interleaved)."""
import collections
import os
import time

TAIL_LINES = 20
MAX_LINE = 1 << 16  # a longer run of bytes without a newline is written as it is
PARTIAL_AFTER = 0.3  # an unfinished line after this long with no more output is written
                     # (a prompt: pdb's, input())


class Sink:
    """Writes whole lines to one of the launcher's fds (never a partial line)."""

    def __init__(self, fd):
        self.fd = fd
        self.broken = False

    def write(self, data):
        if self.broken:
            return
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.fd, view)
            except InterruptedError:
                continue
            except BlockingIOError:
                time.sleep(0.001)
                continue
            except OSError:  # a closed pipe (| head): keep supervising, drop output
                self.broken = True
                return
            view = view[n:]


class Stream:
    """One rank's stdout or stderr: splits into lines, prefixes, keeps a tail."""

    def __init__(self, rank, sink, prefix, show, log, keep_tail):
        self.prefix = (b"[%d] " % rank) if prefix else b""
        # torch's init_process_group installs an excepthook that starts every line of a
        # traceback with "[rank<r>]: "; under our own prefix that is said twice
        self.torch_prefix = (b"[rank%d]: " % rank) if prefix else None
        self.sink = sink
        self.show = show
        self.log = log
        self.buf = bytearray()
        self.last_feed = 0.0  # when output last came
        self.tail = collections.deque(maxlen=TAIL_LINES) if keep_tail else None

    def feed(self, data):
        if self.log is not None:
            self.log.write(data)
        self.buf += data
        end = self.buf.rfind(b"\n")
        if end < 0 and len(self.buf) >= MAX_LINE:
            end = len(self.buf) - 1
        if end >= 0:
            chunk = bytes(self.buf[:end + 1])
            del self.buf[:end + 1]
            self._emit(chunk.split(b"\n")[:-1] if chunk.endswith(b"\n") else [chunk])
        self.last_feed = time.monotonic()

    def flush_partial(self, now):
        """Write an unfinished line, as a line of its own, once the rank has written nothing
        more for PARTIAL_AFTER seconds (a prompt waiting for input)."""
        if self.buf and now - self.last_feed >= PARTIAL_AFTER:
            self._emit([bytes(self.buf)])
            self.buf.clear()

    def close(self):
        if self.buf:
            self._emit([bytes(self.buf)])
            self.buf.clear()
        if self.log is not None:
            self.log.close()

    def _emit(self, lines):
        if self.torch_prefix is not None:
            tp = self.torch_prefix
            lines = [line[len(tp):] if line.startswith(tp) else line for line in lines]
        if self.tail is not None:
            self.tail.extend(line.decode(errors="replace") for line in lines)
        if self.show:
            self.sink.write(b"".join(self.prefix + line + b"\n" for line in lines))

