"""2D and 3D tensor-parallel layers (one import point)."""
from .layout_nd import (LAYOUT_2D, LAYOUT_3D_A, LAYOUT_3D_B, Layout, gather_output,
                        split_input)
from .mesh2d import Linear2D
from .mesh3d import Linear3D
from .norm_nd import LayerNorm2D, LayerNorm3D, RMSNorm2D, RMSNorm3D
from .vocab_nd import (Classifier2D, Classifier3D, Embedding2D, Embedding3D,
                       cross_entropy_2d, cross_entropy_3d, cross_entropy_nd)

__all__ = ["Layout", "LAYOUT_2D", "LAYOUT_3D_A", "LAYOUT_3D_B", "split_input", "gather_output",
           "Linear2D", "Linear3D", "LayerNorm2D", "LayerNorm3D", "RMSNorm2D", "RMSNorm3D",
           "Embedding2D", "Embedding3D", "Classifier2D", "Classifier3D", "cross_entropy_nd",
           "cross_entropy_2d", "cross_entropy_3d"]
