"""glibc's malloc thresholds for training workers that ``phalanx run`` and ``phalanx join`` start.

A CPU training step frees its activations and gradients (megabytes each) and
allocates them again at the next step. With glibc's defaults the large ones are
mapped afresh or trimmed off the heap each time, so every step faults the same
pages in again: on ResNet-20 with 2 workers that was 14-22% of the step
(docs/performance.md, section 8). Raising both thresholds keeps freed blocks in
the heap for the next step to reuse; the workers' peak resident memory did not
grow (455 MiB either way). Both are needed: the trim threshold alone switches
off glibc's adaptive mmap threshold and doubles the step time.

Your own ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` (or
``PHALANX_ALLOCATOR=system``) leaves the allocator as it is. Other C libraries
ignore these variables.

Example:
    >>> heap_env({})["MALLOC_TRIM_THRESHOLD_"]
    '2147483648'
    >>> heap_env({"MALLOC_MMAP_THRESHOLD_": "65536"}), heap_env({"PHALANX_ALLOCATOR": "system"})
    ({}, {})
"""
from __future__ import annotations

from typing import Mapping

MMAP_THRESHOLD = 32 * 2**20  # glibc's ceiling for this threshold on 64-bit systems
TRIM_THRESHOLD = 2 * 2**30


def heap_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a worker gets on top of ``environ`` (none when the user chose an allocator setting)."""
    chosen = {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(environ)
    if chosen or environ.get("PHALANX_ALLOCATOR", "") == "system":
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
