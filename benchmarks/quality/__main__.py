"""``python -m benchmarks.quality``: see :mod:`benchmarks.quality.cli`."""
import sys

from phalanx.errors import ConfigError, PhalanxError
from .cli import main

try:
    sys.exit(main())
except PhalanxError as err:  # a usage error is one line, as ``python -m benchmarks.quality`` prints it
    print(f"python -m benchmarks.quality: {err}", file=sys.stderr)
    sys.exit(2 if isinstance(err, ConfigError) else 1)
