"""The check that a figure the report wrote is a real PNG."""
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    """`path` starts with the PNG signature and holds more than a stub."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert len(data) > 1000, f"{path} is suspiciously small ({len(data)} bytes)"
