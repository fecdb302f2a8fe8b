"""The XLA backend: torch-xla access (imported lazily), HLO reading, graph counters and
Neuron compiler settings."""
