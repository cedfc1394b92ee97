"""Hostile-input tests: each reproduces a finding of the attacker's pass against the
IPC layer. The fake engine of tests/ipc keeps them fast."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ipc"))  # fake_engine
