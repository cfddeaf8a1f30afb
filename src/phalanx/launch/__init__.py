"""``phalanx run`` and ``phalanx join``: the command line, the elastic agent, worker processes, SLURM, Ray Train."""
