"""The distributed core: the mesh and its groups, the collectives, the autograd regions
around them, parameter sharding metadata, the cross-rank agreement checks."""
