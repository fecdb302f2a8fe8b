import os
import sys

# Tests run on the CPU: torch-xla's CPU PJRT device for XLA checks, gloo for multi-rank numerics.
os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))
