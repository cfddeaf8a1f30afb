"""The tests synchronise with events, store keys, markers and process exits, never by sleeping.

Every ``sleep(`` left in tests/ says why on its line or the line above (``# sleep: <reason>``): a sleep that is
the behaviour under test (a slow step, a stopped worker, a clock that must pass) is allowed, a sleep that waits
for another process or paces a test is not; the one poll of a marker is :func:`support.wait.until`.
"""
from __future__ import annotations

import os
import re

from support.paths import TESTS

MOST = 20  # sleeps in tests/, each with its reason


def sleeps() -> list[tuple[str, int, str]]:
    """(file, line number, reason or '') of every ``sleep(`` call in tests/."""
    found = []
    for folder, _, files in os.walk(TESTS):
        for f in sorted(files):
            if not f.endswith(".py") or f == os.path.basename(__file__):
                continue
            path = os.path.join(folder, f)
            lines = open(path).read().split("\n")
            for i, line in enumerate(lines):
                if re.search(r"\bsleep\(", line):
                    said = re.search(r"# sleep: (.+)", line) or (i and re.search(r"# sleep: (.+)", lines[i - 1]))
                    found.append((os.path.relpath(path, TESTS), i + 1, said.group(1) if said else ""))
    return found


def test_every_sleep_in_the_tests_says_why_and_there_are_few():
    found = sleeps()
    print("\n".join(f"{f}:{n}: {why}" for f, n, why in found))
    assert [(f, n) for f, n, why in found if not why] == [], "synchronise instead, or say why with '# sleep: ...'"
    assert len(found) <= MOST
