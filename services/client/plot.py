"""A dependency-free PNG line plot, so ``hypha demo`` can draw its loss
curve without pulling a plotting library into every install."""

from __future__ import annotations

import itertools
import struct
import zlib
from pathlib import Path

# 3x5 bitmap digits (and '.', '-') for axis labels.
_GLYPHS = {
    "0": "111101101101111",
    "1": "010110010010111",
    "2": "111001111100111",
    "3": "111001111001111",
    "4": "101101111001001",
    "5": "111100111001111",
    "6": "111100111101111",
    "7": "111001001001001",
    "8": "111101111101111",
    "9": "111101111001111",
    ".": "000000000000010",
    "-": "000000111000000",
}


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width = width
        self.height = height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def set(self, x: int, y: int, rgb: tuple[int, int, int]) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i : i + 3] = bytes(rgb)

    def line(self, x0: int, y0: int, x1: int, y1: int, rgb: tuple[int, int, int], thick: int = 1) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for k in range(steps + 1):
            x = round(x0 + (x1 - x0) * k / steps)
            y = round(y0 + (y1 - y0) * k / steps)
            for dx in range(thick):
                for dy in range(thick):
                    self.set(x + dx, y + dy, rgb)

    def text(
        self, x: int, y: int, text: str, rgb: tuple[int, int, int] = (60, 60, 60), scale: int = 2
    ) -> None:
        for n, char in enumerate(text):
            glyph = _GLYPHS.get(char)
            if glyph is None:
                continue
            for row in range(5):
                for col in range(3):
                    if glyph[row * 3 + col] == "1":
                        for sx in range(scale):
                            for sy in range(scale):
                                self.set(x + n * 4 * scale + col * scale + sx, y + row * scale + sy, rgb)

    def png(self) -> bytes:
        rows = b"".join(
            b"\x00" + bytes(self.pixels[y * self.width * 3 : (y + 1) * self.width * 3])
            for y in range(self.height)
        )

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows, 9))
            + chunk(b"IEND", b"")
        )


def line_plot(xs: list[float], ys: list[float], path: Path, width: int = 640, height: int = 400) -> Path:
    """Plot ys against xs with labelled axes (min/max); writes a PNG at ``path``."""
    canvas = Canvas(width, height)
    left, right, top, bottom = 70, width - 20, 20, height - 40
    canvas.line(left, bottom, right, bottom, (0, 0, 0))
    canvas.line(left, top, left, bottom, (0, 0, 0))
    if xs and ys:
        x_lo, x_hi = min(xs), max(xs)
        y_lo, y_hi = min(ys), max(ys)
        x_span = (x_hi - x_lo) or 1.0
        y_span = (y_hi - y_lo) or 1.0

        def px(x: float, y: float) -> tuple[int, int]:
            return (
                round(left + (x - x_lo) / x_span * (right - left)),
                round(bottom - (y - y_lo) / y_span * (bottom - top)),
            )

        points = [px(x, y) for x, y in zip(xs, ys, strict=True)]
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            canvas.line(x0, y0, x1, y1, (31, 119, 180), thick=2)
        canvas.text(4, top, f"{y_hi:.3f}")
        canvas.text(4, bottom - 10, f"{y_lo:.3f}")
        canvas.text(left, bottom + 12, f"{x_lo:g}")
        canvas.text(right - 40, bottom + 12, f"{x_hi:g}")
    path.write_bytes(canvas.png())
    return path
