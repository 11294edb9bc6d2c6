"""Sphinx extension: the repository and launch buttons come from one setting.

The book's repository is set by one environment variable, read when the book
is built::

    NORMLIB_REPOSITORY_URL=https://github.com/<owner>/<repo> make book

With it, every page gets the repository and issue buttons, and every chapter
the Binder and Colab launch buttons configured under ``launch_buttons:`` in
``_config.yml`` (Colab only for a GitHub repository, the one host it opens).
Without it those buttons are left out, so that no button leads to a
repository that does not exist; the download button stays either way.

``book/_tools/add_setup_cell.py`` reads the same variable to write the
install command into the chapters' set-up cell, and ``setup.py`` to write
the package's project URLs. So that the packaging can read it without
Sphinx, this file imports Sphinx only inside the hook Sphinx calls.
"""

from __future__ import annotations

import os
import re

ENV = "NORMLIB_REPOSITORY_URL"
_URL = re.compile(r"^https://[^/\s]+/[^/\s]+/[^/\s]+$")


def repository_url() -> str:
    """The configured repository URL, normalised (no trailing slash or .git), or ``""``."""
    url = os.environ.get(ENV, "").strip().rstrip("/")
    if url.endswith(".git"):
        url = url[: -len(".git")]
    if url and not _URL.match(url):
        raise ValueError(f"{ENV} must be a repository's https URL like https://github.com/<owner>/<repo> (got {url!r})")
    return url


def _configure(app, config):
    from sphinx.errors import ConfigError

    try:
        url = repository_url()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    options = dict(config.html_theme_options or {})
    launch = dict(options.get("launch_buttons") or {})
    if url:
        options["repository_url"] = url
        options["use_repository_button"] = True
        options["use_issues_button"] = True
        if not url.startswith("https://github.com/"):
            launch.pop("colab_url", None)  # Colab opens notebooks from GitHub only
            launch.pop("deepnote_url", None)
        options["launch_buttons"] = launch
    else:
        options["repository_url"] = ""
        for button in ("use_repository_button", "use_issues_button", "use_edit_page_button"):
            options[button] = False
        # no launcher without a repository to launch from
        for key in ("binderhub_url", "jupyterhub_url", "colab_url", "deepnote_url", "jupyterlite_url"):
            launch.pop(key, None)
        launch["thebe"] = False
        options["launch_buttons"] = launch
    config.html_theme_options = options


def setup(app):
    app.connect("config-inited", _configure)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
