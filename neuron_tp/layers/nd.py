"""2D and 3D tensor-parallel layers, one import point for the files that hold them:

* ``activation_layout.py``: :class:`ActivationLayout` (``LAYOUT_2D``, ``LAYOUT_3D_A/B``),
  ``split_input`` / ``gather_output`` (full activation <-> this rank's block);
* ``linear_2d.py`` / ``linear_3d.py``: :class:`Linear2D` / :class:`Linear3D`;
* ``norm_nd.py``: LayerNorm / RMSNorm; ``vocab_nd.py``: embedding, classifier, cross-entropy.
"""

from .activation_layout import (
    LAYOUT_2D,
    LAYOUT_3D_A,
    LAYOUT_3D_B,
    ActivationLayout,
    Layout,
    gather_output,
    split_input,
)
from .linear_2d import Linear2D
from .linear_3d import Linear3D
from .norm_nd import LayerNorm2D, LayerNorm3D, RMSNorm2D, RMSNorm3D
from .vocab_nd import (
    Classifier2D,
    Classifier3D,
    Embedding2D,
    Embedding3D,
    cross_entropy_2d,
    cross_entropy_3d,
    cross_entropy_nd,
    gather_logits,
)

__all__ = [
    "ActivationLayout",
    "Layout",
    "LAYOUT_2D",
    "LAYOUT_3D_A",
    "LAYOUT_3D_B",
    "split_input",
    "gather_output",
    "Linear2D",
    "Linear3D",
    "LayerNorm2D",
    "LayerNorm3D",
    "RMSNorm2D",
    "RMSNorm3D",
    "Embedding2D",
    "Embedding3D",
    "Classifier2D",
    "Classifier3D",
    "cross_entropy_nd",
    "gather_logits",
    "cross_entropy_2d",
    "cross_entropy_3d",
]
