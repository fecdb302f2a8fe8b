"""``neuron-tp selftest``: checks that prove the library on the job's own devices (collectives,
bandwidth, layers, a tiny model, compiles, matmul throughput), and the planner calibration they
measure."""
