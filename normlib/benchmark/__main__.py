"""``python -m normlib.benchmark``: the GPU kernel benchmark (see :mod:`normlib.benchmark`)."""

import sys

from . import main

sys.exit(main())
