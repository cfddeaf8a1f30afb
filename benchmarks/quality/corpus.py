"""The GPT task's text: the Python standard library's own sources, read from this interpreter.

Nothing is downloaded. A fixed, sorted list of modules is read from
``sysconfig.get_paths()["stdlib"]`` and concatenated; the SHA-256 of that text is
checked against the hash recorded for this Python version, so every run (and every
machine with the same Python) trains on exactly the same bytes. Another Python
version has other sources: the loader refuses, naming both hashes, rather than
quietly training on different text.

Example:
    >>> text = load()                  # 1.3 MB of Python on CPython 3.11.7
    >>> len(FILES), len(text) > 1_000_000
    (20, True)
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig

from phalanx.errors import ConfigError, usage

FILES = sorted([
    "argparse.py", "ast.py", "collections/__init__.py", "dataclasses.py", "difflib.py", "enum.py",
    "functools.py", "inspect.py", "json/decoder.py", "json/encoder.py", "logging/__init__.py", "pathlib.py",
    "random.py", "statistics.py", "subprocess.py", "tarfile.py", "textwrap.py", "threading.py", "typing.py",
    "zipfile.py",
])
# SHA-256 of the concatenation (in FILES order, bytes as stored) per interpreter version.
SHA256 = {
    "3.11.7": "81a31ffe7203f86358ea082f6bb800917f711b5081ff79331b7f80c189d1702e",
}


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def digest(text: bytes) -> str:
    return hashlib.sha256(text).hexdigest()


def load(root: str | None = None, *, expected: str | None = None) -> bytes:
    """The corpus as bytes; raises ConfigError when a file is missing or the hash differs.

    ``expected`` defaults to the hash recorded for the running Python version.
    """
    root = root or stdlib_dir()
    version = ".".join(map(str, sys.version_info[:3]))
    if expected is None:
        expected = SHA256.get(version)
        if expected is None:
            raise ConfigError(usage(f"Python {version} (stdlib at {root})",
                                    "a Python whose corpus hash is recorded: " + ", ".join(sorted(SHA256)),
                                    "Run the benchmark with that interpreter, or record this version's hash in "
                                    "benchmarks.quality.corpus.SHA256 (results then use a different corpus)."))
    parts = []
    for name in FILES:
        path = os.path.join(root, name)
        try:
            with open(path, "rb") as f:
                parts.append(f.read())
        except OSError as err:
            raise ConfigError(usage(f"corpus file {path} ({err.strerror})", "the standard library's sources",
                                    "Use an interpreter installed with its .py sources.")) from None
    text = b"".join(parts)
    found = digest(text)
    if found != expected:
        raise ConfigError(usage(f"corpus SHA-256 {found} (from {len(FILES)} files under {root})",
                                f"SHA-256 {expected}",
                                "The standard library's sources differ from the ones the benchmark is fixed to; "
                                "use the recorded Python version, so results compare."))
    return text
