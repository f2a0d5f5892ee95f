"""Human-readable output: aligned tables and numbers with units (GiB, GFLOP, ms).

Plain text on purpose: the same string goes to a terminal, a log file, a test assertion and the
README, so it must not depend on terminal width or colour support.
"""
from __future__ import annotations

from typing import Iterable, Sequence


def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]], title: str | None = None) -> str:
    """Left-align text columns and right-align numeric-looking ones."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    numeric = [all(_looks_numeric(row[i]) for row in cells) and bool(cells) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    out = [title] if title else []
    out.append(line(list(headers)))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def _looks_numeric(text: str) -> bool:
    head = text.split(" ")[0].rstrip("%x")
    try:
        float(head.replace(",", ""))
        return True
    except ValueError:
        return text in ("-", "")


def human_bytes(n: float) -> str:
    """Bytes in binary units: '512 B', '3.0 KiB', '1.25 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_flops(n: float) -> str:
    """FLOPs in decimal units: '12.0 MFLOP', '3.40 TFLOP'."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def human_count(n: float) -> str:
    """Counts: '1.2K', '340M', '1.5B'."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
