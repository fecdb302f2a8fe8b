"""The command line, the top layer (imports everything, imported by nothing):
``neuron-tp train|generate|serve|consolidate|plan|selftest``."""

from .entry import main

__all__ = ["main"]
