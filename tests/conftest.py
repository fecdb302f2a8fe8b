import os
import sys

# Tests run on the CPU: torch-xla's CPU PJRT device for XLA checks, gloo for multi-rank numerics.
os.environ.setdefault("PJRT_DEVICE", "CPU")
# XLA:CPU compiles of the tests' tiny graphs cost more than running them: unoptimised LLVM
# (about 40% less CPU per compile-heavy process, same values to float rounding). Set before
# torch_xla is imported; every subprocess (XLA devices, CLI runs) inherits it.
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_flags, *(f for f in _FAST_COMPILE if f.split("=")[0] not in _flags)]
).strip()
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))
