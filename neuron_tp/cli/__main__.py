"""``python -m neuron_tp.cli ...``."""

import sys

from .entry import main

sys.exit(main())
