"""The installed loraserve's version, as `loraserve --version` and the server's /version report it."""
from __future__ import annotations

import importlib.metadata


def package_version() -> str:
    """The installed loraserve's version ("unknown" when it runs from a source tree that is not installed)."""
    try:
        return importlib.metadata.version("loraserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
