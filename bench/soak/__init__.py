"""A soak run: a simulated fleet and a gateway under steady mixed traffic for a long time, sampled
for memory, file descriptors, threads and collector passes, to show whether the serving processes
hold their footprint over hours. See `python -m bench.soak --help`."""
