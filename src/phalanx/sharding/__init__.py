"""Sharded state: the FSDP2 layout within a replica group (layout), a model built on the meta device (meta), and
resharding a commit onto a new layout (reshard)."""
