"""Where the repository's own files are: :data:`REPO_ROOT` (the checkout this package runs from: the package is
installed in development mode, ``make setup``) and :data:`CONFIG_DIR` (its ``config/``: models, references, node
parameters, thresholds). Plain Python, no rclpy, no torch: anything may import it."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "config"
