"""Where infinikv keeps what it downloads or builds (never inside the repository)."""

import os
from pathlib import Path


def home() -> Path:
    """``$INFINIKV_HOME``, default ``~/.cache/infinikv``."""
    return Path(os.environ.get("INFINIKV_HOME") or Path.home() / ".cache" / "infinikv")


def models_dir() -> Path:
    return home() / "models"


def data_dir() -> Path:
    return home() / "data"
