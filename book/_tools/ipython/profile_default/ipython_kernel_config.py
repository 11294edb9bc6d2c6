"""IPython settings for the kernels that execute the chapters.

Used by `make notebooks` (book/_tools/execute_notebooks.py) and by the nbval
runs (book/conftest.py), which both point IPYTHONDIR at book/_tools/ipython,
so that the stored outputs and their re-check come from the same settings.
A reader's own Jupyter is not affected.
"""

c = get_config()  # noqa: F821 (provided by IPython when it loads this file)

# Tracebacks as documentation shows them: the cell's line and the error, without
# the frames inside libraries and without the build machine's file paths.
c.InteractiveShell.xmode = "Docs"

# Warnings likewise: "UserWarning: message", without the path of the file that
# warned (a library's on this machine, or a cell's temporary file whose name
# changes from run to run).
c.InteractiveShellApp.exec_lines = [
    "import warnings as _w; _w.formatwarning = lambda message, category, filename, lineno, line=None: "
    "f'{category.__name__}: {message}\\n'; del _w"
]

# Nothing written into this folder while the chapters run.
c.HistoryManager.enabled = False

# Figures as SVG, crisp at any zoom and on high-DPI screens (a chapter may say so
# itself too). Their date and ids are fixed elsewhere, for every kernel started in
# book/: SOURCE_DATE_EPOCH=0 (set by the execution script and book/conftest.py) and
# book/matplotlibrc (svg.hashsalt), so that nbval can compare them.
c.InlineBackend.figure_formats = {"svg"}
