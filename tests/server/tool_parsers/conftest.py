"""Puts the replay helpers beside this file on sys.path."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
