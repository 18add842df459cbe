"""The pipe engine threads wake a worker loop with: one byte, written without waiting."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

__all__ = ["WakePipe"]


def _gil_holding_write() -> Callable[[int, bytes, int], int] | None:
    """libc ``write`` called WITHOUT releasing the GIL (ctypes.PyDLL), or None if unavailable.

    ``os.write`` releases the GIL; the loop thread, woken by that very byte, then grabs the GIL
    and the forward hook waits for the loop's whole turn before it can return (a convoy of up to
    a millisecond at 256 requests, measured). Writing one byte to a non-blocking pipe cannot
    block, so keeping the GIL is safe and the hook returns at once.
    """
    try:
        fn = ctypes.PyDLL(None).write
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    fn.restype = ctypes.c_ssize_t
    return fn


_raw_write = _gil_holding_write()


class WakePipe:
    """A non-blocking pipe: :meth:`wake` from any thread, :attr:`fd` to poll, :meth:`drain`
    once readable. It stays open until the object goes away: an engine thread may still wake a
    stopped loop, and writing to a closed (possibly reused) fd number would hit another file."""

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)

    def wake(self) -> None:
        """Make :attr:`fd` readable; never waits (a full pipe is already readable)."""
        if _raw_write is not None:
            _raw_write(self._w, b"\x00", 1)  # -1 (pipe full: already readable) is fine
            return
        try:
            os.write(self._w, b"\x00")
        except (BlockingIOError, OSError):  # pipe full (already readable) or closed
            pass

    def drain(self) -> None:
        """Read every pending byte."""
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def __del__(self) -> None:
        for fd in (getattr(self, "fd", -1), getattr(self, "_w", -1)):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
