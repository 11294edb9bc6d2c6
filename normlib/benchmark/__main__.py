"""``python -m normlib.benchmark``: the GPU kernel benchmark (see :mod:`normlib.benchmark.gpu`)."""

import sys

from .gpu import main

sys.exit(main())
