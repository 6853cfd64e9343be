"""Terminal tables and sizes, shared by every command that prints results."""

from __future__ import annotations

__all__ = ["format_bytes", "format_table", "indent"]


def format_table(headers: list[str], rows: list[list[str]], *, align: str = "", header: bool = True) -> str:
    """Columns padded to their widest cell; ``align`` holds one ``<`` or ``>`` per column (default ``<``)."""
    cells = ([headers] if header else []) + rows
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))] if cells else []
    align = align.ljust(len(headers), "<")
    lines = []
    for row in cells:
        columns = zip(row, widths, align, strict=True)
        padded = [cell.rjust(w) if a == ">" else cell.ljust(w) for cell, w, a in columns]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; whole bytes below 1 KiB."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{int(n)} B" if i == 0 else f"{n:.1f} {units[i]}"


def indent(text: str) -> str:
    return "\n".join(f"  {line}" if line else line for line in text.split("\n"))
