"""Times and durations as people read them: ISO 8601 in local time, with its offset.

Files and JSON keep epoch seconds (SPEC); what is printed for a person uses these.
"""

from __future__ import annotations

import math
from datetime import datetime


def local_time(ts: float | None, *, millis: bool = False) -> str:
    """Epoch seconds as ISO 8601 local time with the UTC offset: in UTC,
    ``2025-10-09T08:53:20+00:00`` (``millis``: ``2025-10-09T08:53:20.250+00:00``)."""
    if ts is None or not math.isfinite(ts):
        return "unknown"
    try:
        when = datetime.fromtimestamp(ts).astimezone()
    except (OverflowError, OSError, ValueError):  # beyond what the platform's clock can say
        return f"{ts:.3f} (epoch s)"
    return when.isoformat(timespec="milliseconds" if millis else "seconds")


def duration(seconds: float) -> str:
    """``50 ms``, ``4.2 s``, ``3.5 min``, ``7.1 h``, ``20790 d``.

    >>> duration(0.0503), duration(2.25), duration(90), duration(5400), duration(1796238599)
    ('50 ms', '2.2 s', '90.0 s', '90.0 min', '20790 d')
    """
    if not math.isfinite(seconds):
        return "unknown"
    if abs(seconds) < 1:
        return f"{seconds * 1000:.0f} ms"
    if abs(seconds) < 120:
        return f"{seconds:.1f} s"
    if abs(seconds) < 7200:
        return f"{seconds / 60:.1f} min"
    if abs(seconds) < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} d"
