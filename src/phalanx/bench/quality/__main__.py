"""``python -m phalanx.bench.quality``: see :mod:`phalanx.bench.quality.cli`."""
import sys

from ...errors import ConfigError, PhalanxError
from .cli import main

try:
    sys.exit(main())
except PhalanxError as err:  # a usage error is one line, as ``phalanx bench --quality`` prints it
    print(f"phalanx bench --quality: {err}", file=sys.stderr)
    sys.exit(2 if isinstance(err, ConfigError) else 1)
