"""Resident anonymous memory of this process, read from ``/proc/self/status`` (Linux).

``RssAnon`` counts heap and tensor memory but not file pages mapped from disk, so it is the
memory an out-of-core optimizer must keep small; its row files show up as ``RssFile`` instead.
"""

from __future__ import annotations

import threading


def _status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_anon_bytes() -> int:
    """Current ``RssAnon`` of this process in bytes (0 where /proc is unavailable)."""
    return _status_bytes("RssAnon:")


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (``VmHWM``: anonymous and file pages)."""
    return _status_bytes("VmHWM:")


class PeakRssAnon:
    """Samples ``RssAnon`` in a background thread while the ``with`` block runs.

    ``peak`` is the highest value seen (sampling every ``interval`` seconds, so a spike
    shorter than that can be missed; the value at exit is always included).
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRssAnon:
        self.peak = rss_anon_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon_bytes())
