"""One step: its clock and the moments a strategy is told of, the end of backward, compile, preemption, profiling."""
