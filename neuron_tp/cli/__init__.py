"""The command line, the top layer (imports everything, imported by nothing):
``neuron-tp train|generate|serve|consolidate|plan``."""

from .entry import main

__all__ = ["main"]
