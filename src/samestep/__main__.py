"""``python -m samestep`` (and ``torchrun ... -m samestep train``)."""

import sys

from samestep.cli import main

sys.exit(main())
