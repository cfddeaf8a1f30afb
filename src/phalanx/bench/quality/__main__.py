"""``python -m phalanx.bench.quality``: see :mod:`phalanx.bench.quality.cli`."""
import sys

from .cli import main

sys.exit(main())
