"""Sharded state: the FSDP2 layout within a replica group, and resharding a commit onto a new layout."""
