"""Sizes as people read them: binary units (KiB, MiB, GiB), written one way everywhere.

The memory calculator, the pre-flight checks, the tutorial's tables, ``collab-kit model-info`` and the
preprocessing report all print bytes through :func:`format_bytes`, so one notebook never shows the same size
as "0.50 GiB" in one cell and "512.0 MiB" in the next.
"""

KiB, MiB, GiB = 2**10, 2**20, 2**30


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit it fills at least once, with two decimals: ``1.50 GiB``,
    ``512.00 MiB``, ``12.00 KiB``; under a KiB, whole bytes (``512 bytes``)."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} bytes"
