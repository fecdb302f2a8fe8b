"""Compile-aware training and inference entry points (``neuron-tp train|generate``).

Importing this package needs torch only; torch-xla and transformers are imported lazily."""
