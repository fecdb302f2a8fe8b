"""The distributed core: the mesh and its groups, the collectives, the autograd regions
around them, parameter sharding metadata, the cross-rank agreement checks and failure reports,
the job's key-value store (a new one per torchrun attempt)."""
