"""pytest configuration for running the chapters under nbval.

Progress bars (tqdm) are for people running a chapter by hand; under nbval
they would add timing-dependent output, so they are switched off here, in the
environment that the notebooks' kernels inherit. The kernels also get the
IPython settings the chapters were executed with (book/_tools/ipython:
tracebacks without machine paths, SVG figures). `make notebooks`
(book/_tools/execute_notebooks.py) does the same.
"""

import os
from pathlib import Path

os.environ["TQDM_DISABLE"] = "True"
os.environ["IPYTHONDIR"] = str(Path(__file__).resolve().parent / "_tools" / "ipython")
# SVG figures are compared too: no timestamp in them (book/matplotlibrc fixes their ids).
os.environ["SOURCE_DATE_EPOCH"] = "0"
