"""The launcher's reaper: kills the ranks' process groups if the launcher dies without
doing it (SIGKILL, the OOM killer).

:class:`Reaper` starts this file as a process of its own (``python -I -S reaper.py FD``:
no site, no path, the standard library only). It reads "+PGID" / "-PGID" lines (a
rank's process group started, or ended) until the launcher's end of the pipe closes,
then SIGKILLs the groups still listed. Signals to the launcher's terminal or group do
not end it: only the pipe does.
"""
import os
import signal
import subprocess
import sys


def reap(fd):
    """The reaper process: read the pipe ``fd`` until it closes, then kill what is left."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    live, buf = set(), b""
    while True:
        data = os.read(fd, 4096)
        if not data:
            break
        *lines, buf = (buf + data).split(b"\n")
        for line in lines:
            (live.add if line[:1] == b"+" else live.discard)(int(line[1:]))
    for pgid in live:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass


class Reaper:
    """Kills the ranks' process groups if the launcher dies without doing it (SIGKILL,
    the OOM killer): a process of its own reads the groups from a pipe and kills those
    still running once the pipe closes, which it does however the launcher ends. A group
    is struck off once the launcher has killed it, so a reused number is never hit."""

    def __init__(self):
        self.fd = None
        r, w = os.pipe()
        try:
            subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), str(r)],
                             pass_fds=(r,), start_new_session=True, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError:  # no reaper: the launcher still cleans up whenever it can
            os.close(w)
            w = None
        finally:
            os.close(r)
        self.fd = w

    def _send(self, line):
        if self.fd is not None:
            try:
                os.write(self.fd, line.encode())
            except OSError:
                pass

    def watch(self, rank):
        self._send(f"+{rank.proc.pid}\n")

    def forget(self, rank):
        self._send(f"-{rank.proc.pid}\n")

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


if __name__ == "__main__":
    reap(int(sys.argv[1]))
