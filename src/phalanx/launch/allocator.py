"""glibc's malloc thresholds for training workers that ``phalanx run`` and ``phalanx join`` start.

A CPU training step frees its activations and gradients (megabytes each) and
allocates them again at the next step. With glibc's defaults the large ones are
mapped afresh or trimmed off the heap each time, so every step faults the same
pages in again: on ResNet-20 with 2 workers that was 14-22% of the step
(docs/performance.md, section 8). Raising both thresholds keeps freed blocks in
the heap for the next step to reuse; the workers' peak resident memory did not
grow (455 MiB either way). Both are needed: the trim threshold alone switches
off glibc's adaptive mmap threshold and doubles the step time.

Kept heaps need few of them: ``MALLOC_ARENA_MAX=2``. An elastic worker frees each
generation's buffers (gloo's, the state sent to a joiner, resharded shards) in threads
that come and go with the generation, and glibc gives threads their own arenas (up to
8 per core), each keeping what was freed in it. A survivor's resident memory then grew
with every membership change; with two arenas, and ``malloc_trim`` once a regroup, grow
or join has its new state in place (:func:`phalanx.group.leaving.give_back_freed_memory`),
it stays flat: ``benchmarks/regroup_memory.py --shard 2``, 10 kills, worker 0's RSS
after each grow 1.33x (+15.9 MB a regroup) -> 1.06x (+2.6 MB).

Your own ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` (your own
``MALLOC_ARENA_MAX`` for the arenas; ``PHALANX_ALLOCATOR=system`` for all three) leaves
the allocator as it is. Other C libraries ignore these variables.

Example:
    >>> heap_env({})["MALLOC_TRIM_THRESHOLD_"], heap_env({})["MALLOC_ARENA_MAX"]
    ('2147483648', '2')
    >>> heap_env({"MALLOC_MMAP_THRESHOLD_": "65536"}), heap_env({"PHALANX_ALLOCATOR": "system"})
    ({'MALLOC_ARENA_MAX': '2'}, {})
"""
from __future__ import annotations

from typing import Mapping

MMAP_THRESHOLD = 32 * 2**20  # glibc's ceiling for this threshold on 64-bit systems
TRIM_THRESHOLD = 2 * 2**30
ARENA_MAX = 2


def heap_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a worker gets on top of ``environ`` (none that the user chose an allocator setting for)."""
    if environ.get("PHALANX_ALLOCATOR", "") == "system":
        return {}
    env = {} if "MALLOC_ARENA_MAX" in environ else {"MALLOC_ARENA_MAX": str(ARENA_MAX)}
    if not {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(environ):  # a pair: both or neither
        env.update(MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), MALLOC_TRIM_THRESHOLD_=str(TRIM_THRESHOLD))
    return env
