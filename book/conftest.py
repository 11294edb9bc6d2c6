"""pytest configuration for running the chapters under nbval.

Progress bars (tqdm) are for people running a chapter by hand; under nbval
they would add timing-dependent output, so they are switched off here, in the
environment that the notebooks' kernels inherit. `make notebooks` does the same.
"""

import os

os.environ["TQDM_DISABLE"] = "True"
# SVG figures are compared too: no timestamp in them (book/matplotlibrc fixes their ids).
os.environ["SOURCE_DATE_EPOCH"] = "0"
