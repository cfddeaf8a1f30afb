"""Helpers for phalanx's own tests (not part of the package)."""
