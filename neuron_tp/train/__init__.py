"""The training job (``neuron-tp train``): setup, the compiled step, the loop, evaluation,
metrics, the checkpoint policy and the guards (graph agreement, non-finite values, preemption).

Importing this package needs torch only; torch-xla and transformers are imported lazily."""
