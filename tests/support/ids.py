"""Block ids as the wire carries them: a raw frame of little-endian int64."""

from __future__ import annotations

import numpy as np


def id_frame(*values: int) -> bytes:
    """The raw frame of these block ids (``<i8``, the protocol's default id dtype)."""
    return np.array(values, dtype="<i8").tobytes()
