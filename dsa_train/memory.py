"""This process's memory, and the room left for what a run is about to allocate.

``RssAnon`` (read from ``/proc/self/status``, Linux) counts heap and tensor memory but not file
pages mapped from disk, so it is the memory an out-of-core optimizer must keep small; its row
files show up as ``RssFile`` instead.

:func:`require_memory` and :func:`require_disk` refuse a size that cannot fit *before* it is
allocated, with a :class:`~dsa_train.errors.DsaError` naming the recipe key, the bytes needed
and the bytes available. Set ``DSA_MEMORY_CHECK=0`` to skip them (an estimate can be wrong).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

from .errors import DsaError
from .fsutil import libc


def _status_bytes(field: str, pid: int | str = "self") -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_anon_bytes(pid: int | str = "self") -> int:
    """Current ``RssAnon`` of this process (or of process ``pid``) in bytes (0 where /proc is
    unavailable or the process is gone)."""
    return _status_bytes("RssAnon:", pid)


def rss_hard_bytes(pid: int | str = "self") -> int:
    """``RssAnon + RssShmem``: the memory the kernel cannot drop without swap."""
    return _status_bytes("RssAnon:", pid) + _status_bytes("RssShmem:", pid)


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


# -- room for what is about to be allocated ------------------------------------------------

_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")


def human_bytes(n: int | float) -> str:
    """``n`` bytes in binary units: ``'512 bytes'``, ``'1.5 GiB'``."""
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{int(value):,} bytes" if unit == 0 else f"{value:,.1f} {_UNITS[unit]}"


def _size(n: int) -> str:
    """``'1.5 GiB (1,610,612,736 bytes)'``; ``'1,000 bytes'`` below a KiB."""
    return human_bytes(n) if abs(n) < 1024 else f"{human_bytes(n)} ({n:,} bytes)"


def _meminfo() -> dict[str, int]:
    found = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    found[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return found


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_room() -> int | None:
    """What the memory cgroup (v2, else v1) still lets this process take, or ``None`` without a limit.

    Reclaimable page cache (``inactive_file``) counts as room, as it does in ``MemAvailable``."""
    for limit_file, usage_file, stat_file, inactive in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat", "inactive_file"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
            "/sys/fs/cgroup/memory/memory.stat",
            "total_inactive_file",
        ),
    ):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is None or usage is None or limit >= 1 << 60:  # "max", or v1's "no limit"
            continue
        cache = 0
        try:
            for line in Path(stat_file).read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == inactive and value.strip().isdigit():
                    cache = int(value)
        except OSError:
            pass
        return max(limit - usage + cache, 0)
    return None


def host_available_bytes() -> int | None:
    """Memory this process can still take: ``MemAvailable`` plus free swap from ``/proc/meminfo``
    (else free pages from ``sysconf``), capped by a memory cgroup's limit and by ``ulimit -v``;
    ``None`` if unknown."""
    info = _meminfo()
    available = None
    if "MemAvailable" in info:
        available = info["MemAvailable"] + info.get("SwapFree", 0)
    else:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            pass
    for room in (_cgroup_room(), _address_space_room()):
        if room is not None:
            available = room if available is None else min(available, room)
    return available


def host_total_bytes() -> int | None:
    """The machine's memory (``MemTotal``), capped by a memory cgroup's limit; ``None`` if unknown."""
    total = _meminfo().get("MemTotal")
    limits = [_read_int(f) for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")]
    limit = min((n for n in limits if n is not None and n < 1 << 60), default=None)  # "max", or v1's "no limit"
    if limit is not None:
        total = limit if total is None else min(total, limit)
    return total


def _address_space_room() -> int | None:
    """What ``ulimit -v`` (``RLIMIT_AS``) still lets this process map, or ``None`` without a limit."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError):
        return None
    if limit == resource.RLIM_INFINITY:
        return None
    return max(limit - _status_bytes("VmSize:"), 0)


def device_available_bytes(device) -> int | None:
    """Free memory of a CUDA device (free to the driver plus cached by torch's allocator); the
    host's for any other device; ``None`` if unknown."""
    if device is None or getattr(device, "type", str(device)) != "cuda":
        return host_available_bytes()
    import torch

    try:
        free, _total = torch.cuda.mem_get_info(device)
        return int(free) + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    except Exception:  # no driver or no such device: the caller finds out when it allocates
        return None


def checks_enabled() -> bool:
    return os.environ.get("DSA_MEMORY_CHECK", "1").strip() not in ("0", "off", "false", "no")


def require_memory(
    what: str, needed: int, *, key: str, hint: str, device=None, reserved: int = 0, reserved_for: str = ""
) -> None:
    """Refuse, before allocating, ``needed`` bytes that do not fit in the memory of ``device``
    (the host's when ``None`` or a CPU) once ``reserved`` bytes (``reserved_for``, allocated
    first) are taken. ``key``: the recipe setting(s) that size it, as ``key=value``.

    Where the available memory is unknown, nothing is refused."""
    if needed <= 0 or not checks_enabled():
        return
    available = device_available_bytes(device)
    if available is None:
        return
    room = available - reserved
    if needed <= room:
        return
    where = "memory" if device is None or getattr(device, "type", str(device)) != "cuda" else f"memory on {device}"
    message = f"{key}: {what} would take {_size(needed)} of {where}, but only {_size(max(room, 0))} is available"
    if reserved:
        message += (
            f" (of {human_bytes(available)} free, {human_bytes(reserved)} go to {reserved_for or 'what comes first'})"
        )
    raise DsaError(message, hint=f"{hint} (DSA_MEMORY_CHECK=0 skips this check)")


def free_disk_bytes(folder: str | Path) -> int | None:
    """Free bytes (to this user) of the file system that holds ``folder`` (or its nearest
    existing parent); ``None`` if unknown."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stats = os.statvfs(path)
    except (AttributeError, OSError):
        return None
    return stats.f_bavail * stats.f_frsize


def require_disk(what: str, needed: int, folder: str | Path, *, key: str, hint: str) -> None:
    """Refuse, before writing, a file of ``needed`` bytes that does not fit on the disk of ``folder``."""
    if needed <= 0 or not checks_enabled():
        return
    available = free_disk_bytes(folder)
    if available is None or needed <= available:
        return
    raise DsaError(
        f"{key}: {what} would take {_size(needed)} of disk in '{folder}', but only {_size(available)} is free there",
        hint=f"{hint} (DSA_MEMORY_CHECK=0 skips this check)",
    )


def release_free_heap() -> bool:
    """Hand the C heap's free memory back to the kernel (glibc's ``malloc_trim(0)``, every
    arena): after work that allocated in several threads, glibc keeps each thread's freed
    arena pages, counted in RssAnon until reused. ``False`` where there is no glibc."""
    try:
        trim = libc().malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
