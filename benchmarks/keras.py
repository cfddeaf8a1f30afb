"""Keras 3 with phalanx beside plain PyTorch: the same as ``phalanx bench --keras`` (kept for old commands).

    python benchmarks/keras.py --repeats 3 --out results/keras
"""
from __future__ import annotations

import os
import sys

# Run as a script, this file's directory comes first on sys.path, and this file is named keras.py:
# drop that entry so `import keras` finds Keras, not this benchmark.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != HERE]

from phalanx.bench.keras_setup import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
