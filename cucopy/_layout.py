"""Byte geometry of strided arrays: 2-D forms, blocks and conservative extents."""

from __future__ import annotations

import math

__all__ = ["form", "blocks", "extent", "tail_blocks"]


def form(ptr: int, shape, strides, itemsize: int):
    """Express a view as ``(ptr, rows, width, pitch)`` or return None.

    Contiguous views give one row. A view whose last dimension is dense and
    whose other dimensions collapse into evenly pitched rows (``table[:n, :m]``)
    gives ``rows`` rows of ``width`` bytes; a 1-D strided view gives rows of one
    element. Anything else (gaps between planes, overlapping or negative
    strides) returns None.
    """
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    if not dims:
        return (ptr, 1, itemsize, itemsize)
    if dims[-1][1] != itemsize:
        dims.append((1, itemsize))
    # collapse trailing dense dims into the row width
    width = itemsize
    while dims and dims[-1][1] == width:
        n, _ = dims.pop()
        width *= n
    if not dims:
        return (ptr, 1, width, width)
    rows, pitch = dims[-1]
    for n, s in reversed(dims[:-1]):
        if s != pitch * rows:
            return None
        rows *= n
    if pitch < width:
        return None
    return (ptr, rows, width, pitch)


def blocks(ptr: int, shape, strides, itemsize: int) -> list:
    """Cover a view with 2-D forms in C order (splitting leading dims as needed)."""
    f = form(ptr, shape, strides, itemsize)
    if f is not None:
        return [f]
    out = []
    for i in range(shape[0]):
        out.extend(blocks(ptr + i * strides[0], shape[1:], strides[1:], itemsize))
    return out


def extent(ptr: int, shape, strides, itemsize: int) -> tuple[int, int]:
    """Conservative byte range ``[lo, hi)`` touched by a view (empty views: ``(ptr, ptr)``)."""
    if math.prod(shape) == 0:
        return ptr, ptr
    lo = hi = ptr
    for n, s in zip(shape, strides):
        d = (n - 1) * s
        if d < 0:
            lo += d
        else:
            hi += d
    return lo, hi + itemsize


def tail_blocks(f, start: int, itemsize: int) -> list:
    """2-D forms covering elements ``start:`` of a view whose form is ``f``."""
    ptr, rows, width, pitch = f
    per_row = width // itemsize
    r0, c0 = divmod(start, per_row)
    out = []
    if c0:
        # one row: its pitch is its width (a row's pitch means nothing, and a wide
        # view's pitch may not fit a descriptor's 32-bit field)
        w = width - c0 * itemsize
        out.append((ptr + r0 * pitch + c0 * itemsize, 1, w, w))
        r0 += 1
    if r0 < rows:
        out.append((ptr + r0 * pitch, rows - r0, width, pitch if rows - r0 > 1 else width))
    return out
