"""``phalanx.elastic.commits``'s old names, for one release: the module is now three.

The snapshot ring is :mod:`phalanx.elastic.state`, what happens after a membership change is
:mod:`phalanx.elastic.recovery`, and the re-entry loop is :mod:`phalanx.elastic.run`.
"""
from __future__ import annotations

from .run import _Leave, _Resize, is_peer_failure, run
from .state import DEFAULT_COMMIT_EVERY, KEEP, State, attach

__all__ = ["State", "run", "attach", "is_peer_failure", "DEFAULT_COMMIT_EVERY", "KEEP", "_Resize", "_Leave"]
