"""GPU tests build their tiny checkpoints with the integration tests' ``tiny_models``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
