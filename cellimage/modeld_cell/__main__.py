"""``python -m modeld_cell`` is ``modeld-cell``."""

import sys

from .cli import main

sys.exit(main())
