"""Which samples each worker reads: the sharded loader, the epoch's plan, speed-balanced shares, device prefetch."""
