"""Where forerun keeps downloaded and converted models: FORERUN_HOME, else ~/.cache/forerun."""

from __future__ import annotations

import os
from pathlib import Path


def forerun_home() -> Path:
    root = os.environ.get("FORERUN_HOME")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "forerun"
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    path = forerun_home() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def converted_dir() -> Path:
    path = forerun_home() / "converted"
    path.mkdir(parents=True, exist_ok=True)
    return path
