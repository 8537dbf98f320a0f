"""A live CPU tensor's memory handed back to the OS between its uses (`release_pages`).

`madvise(MADV_DONTNEED)` on the whole pages inside a tensor's bytes: the tensor, its
storage and every view of it stay valid, its resident memory goes, and the next touch maps
fresh pages. What a released page then reads depends on its mapping: zeros in anonymous
private memory (torch's large CPU allocations, `anonymous_private`), the file's bytes in a
private file mapping (a model loaded from safetensors). Callers release only tensors whose
every byte is written before it is read again, or that must read zeros after
(`anonymous_private` says when they will).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

MADV_DONTNEED = 4  # linux/mman.h


class PageReleaseError(RuntimeError):
    """madvise refused to release a tensor's pages (names the tensor)."""


@functools.cache
def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    madvise = getattr(libc, "madvise", None)
    if madvise is not None:
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        madvise.restype = ctypes.c_int
    return madvise


def page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def _whole_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """(first address, bytes) of the whole pages inside `tensor`'s bytes (bytes may be 0)."""
    page = page_size()
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // page) * page
    last = end // page * page
    return first, max(0, last - first)


def release_pages(tensor: torch.Tensor, name: str) -> int:
    """Release the resident pages inside a contiguous CPU `tensor`; returns the bytes released
    (0 off CPU, on a platform without madvise, or for a tensor smaller than a page). The bytes
    at its ends that share a page with other memory are kept."""
    if tensor.device.type != "cpu" or _madvise() is None:
        return 0
    if not tensor.is_contiguous():
        raise PageReleaseError(f"{name}: only a contiguous tensor's pages can be released")
    first, nbytes = _whole_pages(tensor)
    if nbytes == 0:
        return 0
    if _madvise()(first, nbytes, MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        raise PageReleaseError(f"{name}: madvise(MADV_DONTNEED) failed: {os.strerror(err)}")
    return nbytes


def anonymous_private(tensor: torch.Tensor) -> bool:
    """True when every byte of `tensor` lies in one anonymous private mapping (its released
    pages read zeros): /proc/self/maps, so False where that file is missing."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split()
        lo, hi = (int(a, 16) for a in fields[0].split("-"))
        if lo <= start < hi:
            path = fields[5] if len(fields) > 5 else ""
            anonymous = fields[4] == "0" and path in ("", "[heap]")
            return end <= hi and fields[1].endswith("p") and anonymous
    return False
