"""The tests' tiny random checkpoints: runtime/tools/tinyhf.py (the package's, so scripts need no tests/)."""

from runtime.tools.tinyhf import FAMILIES, VOCAB, build_tiny, tiny_config

__all__ = ["FAMILIES", "VOCAB", "build_tiny", "tiny_config"]
