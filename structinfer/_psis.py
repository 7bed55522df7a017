"""What PSIS-LOO needs, read by the diagnostics and by the command line (which must not
load JAX to check its arguments): no imports."""

#: the fewest posterior draws (chains x draws) PSIS-LOO runs on: ArviZ fits its Pareto
#: tail to the largest fifth of the draws and needs at least 5 of them
MIN_DRAWS = 25
