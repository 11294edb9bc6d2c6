"""pytest configuration for running the chapters under nbval.

Progress bars (tqdm) are for people running a chapter by hand; under nbval
they would add timing-dependent output, so they are switched off here, in the
environment that the notebooks' kernels inherit. The kernels also get the
IPython settings the chapters were executed with (book/_tools/ipython:
tracebacks without machine paths, SVG figures). `make notebooks`
(book/_tools/execute_notebooks.py) does the same.

Figures are not compared byte for byte. An SVG figure's text holds its plotted
coordinates to six decimals and clip-path ids derived from them, so it changes
with the last bit of any plotted number, and that bit changes with the CPU
(ATen's vector kernels) and the thread count. nbval therefore leaves the
``image/svg+xml`` output out of its text comparison; instead, each cell that
draws a figure also prints the numbers the figure shows, at a precision that is
the same on every CPU, and those printed lines are compared like every other
output. What is still checked of the figure itself: a cell that stored a figure
must still produce one (and one that stored none must not), and every figure
must be well-formed SVG.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

os.environ["TQDM_DISABLE"] = "True"
os.environ["IPYTHONDIR"] = str(Path(__file__).resolve().parent / "_tools" / "ipython")
os.environ["SOURCE_DATE_EPOCH"] = "0"

SVG = "image/svg+xml"

try:  # nbval is a test dependency; without it this conftest only sets the environment
    from nbval import plugin as _nbval
except ImportError:  # pragma: no cover
    _nbval = None


def _svgs(outputs) -> list[str]:
    return [o["data"][SVG] for o in outputs if "data" in o and SVG in o["data"]]


def _svg_problem(text) -> str | None:
    text = "".join(text) if isinstance(text, list) else text
    try:
        root = ET.fromstring(text.encode() if isinstance(text, str) else text)
    except ET.ParseError as e:
        return f"not well-formed SVG ({e})"
    if not root.tag.endswith("svg"):
        return f"root element is <{root.tag}>, not <svg>"
    return None


if _nbval is not None:
    _compare = _nbval.IPyNbCell.compare_outputs

    def compare_outputs(self, test, ref, skip_compare=None):
        skip = tuple(skip_compare or self.parent.skip_compare) + (SVG,)
        same = _compare(self, test, ref, skip)
        if not same:
            return False
        want, got = len(_svgs(ref)), len(_svgs(test))
        if want != got:
            self.comparison_traceback.append(
                f"the cell stored {want} SVG figure(s) but produced {got} when re-executed"
            )
            return False
        for text in _svgs(test):
            problem = _svg_problem(text)
            if problem:
                self.comparison_traceback.append(f"the cell's figure is {problem}")
                return False
        return True

    _nbval.IPyNbCell.compare_outputs = compare_outputs
