"""The flight recorder's SIGUSR1 handler: a rank's recorders dumped on a signal."""
import logging
import os
import signal
import threading

from .progress import _progress, dump

_log = logging.getLogger("collectives")


class _Signals:
    """SIGUSR1 dumps. The handler is installed only where the program has none (else it
    is chained: ours dumps, then calls the program's). Python runs handlers in the main
    thread only, which may be waiting inside a collective with the GIL released; so where
    the program has set no wakeup fd, the daemon thread also hears the signal through one
    and dumps at once."""

    def __init__(self):
        self.installed = False
        self.previous = None

    def install(self):
        if self.installed or threading.current_thread() is not threading.main_thread():
            return
        if not hasattr(signal, "SIGUSR1"):
            return
        self.installed = True
        try:
            prev = signal.getsignal(signal.SIGUSR1)
            if prev is not signal.SIG_DFL and not callable(prev):
                return  # ignored on purpose (SIG_IGN), or handled outside Python: left alone
            self.previous = prev if callable(prev) else None
            signal.signal(signal.SIGUSR1, self._handler)
            r, w = os.pipe()
            os.set_blocking(w, False)
            os.set_blocking(r, False)
            try:
                old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            except (ValueError, OSError):
                old = -2
            if old != -1:  # the program uses its own wakeup fd: leave it
                if old >= 0:
                    signal.set_wakeup_fd(old)
                os.close(r)
                os.close(w)
            else:
                _progress.wake_r = r
        except Exception as e:  # noqa: BLE001
            _log.debug("collectives flight recorder: no SIGUSR1 handler: %r", e)

    def _handler(self, signum, frame):
        _progress.sig_main += 1
        if _progress.sig_main > _progress.sig_daemon:  # the daemon did not dump for this one
            dump(reason="SIGUSR1")
        if self.previous is not None:
            self.previous(signum, frame)


_signals = _Signals()


def install():
    """Install the handler (once, from the main thread; see :class:`_Signals`)."""
    _signals.install()
