"""Who is in the run and how they talk: the group, its environment, collectives, liveness, leaving, spans."""
