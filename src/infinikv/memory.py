"""This process's resident memory: now, and its peak since a mark.

The peak is the kernel's high-water mark, which ``mark_peak`` resets (``/proc/self/clear_refs``,
Linux 4.0 and later), so a phase's peak (a prefill's) is read apart from the process's whole life:
loading a model peaks higher than the model then holds, and would hide what the phase costs.
"""

from __future__ import annotations

import ctypes
import functools
import resource
from pathlib import Path

import psutil

CLEAR_REFS = Path("/proc/self/clear_refs")


def rss() -> int:
    """Bytes resident now."""
    return psutil.Process().memory_info().rss


_before_marks = 0  # the highest peak a ``mark_peak`` reset (``highest`` keeps the whole life's)


def mark_peak() -> int:
    """Start a new peak here (where the kernel lets a process reset its own); returns ``rss()``."""
    global _before_marks
    _before_marks = max(_before_marks, peak())
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        pass  # no reset: ``peak()`` is then the process's whole-life peak, an upper bound
    return rss()


def peak() -> int:
    """The most bytes resident since ``mark_peak`` (the kernel's high-water mark can lag the current
    RSS by a few pages, hence the max)."""
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss())


def highest() -> int:
    """The most bytes resident in the process's whole life, across ``mark_peak`` resets."""
    return max(_before_marks, peak())


def give_back() -> None:
    """Return the allocator's free memory to the system (glibc's ``malloc_trim``): torch frees a
    finished request's tensors to the C heap, which keeps them resident, so without this the RSS
    only grows; elsewhere a no-op."""
    if _libc() is not None:
        _libc().malloc_trim(0)


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None
