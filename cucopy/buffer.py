"""DeviceCopyBuffer: an owner's record of what its device buffer holds (placeholder)."""

from __future__ import annotations

__all__ = ["DeviceCopyBuffer"]


class DeviceCopyBuffer:
    """Owner-side skip-if-unchanged record for a persistent device buffer."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("DeviceCopyBuffer is being written")
