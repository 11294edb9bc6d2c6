"""Package metadata that pyproject.toml cannot hold: the project's URLs, from the one repository setting.

The repository is set by ``NORMLIB_REPOSITORY_URL`` (see the README), read here
by the same function the book's build uses (``book/_ext/repository.py``): with
it the package's metadata names the repository, its issues and its changelog;
without it, no URL (none that might not exist). Everything else is in
``pyproject.toml``.
"""

import importlib.util
from pathlib import Path

from setuptools import setup


def _repository_url() -> str:
    path = Path(__file__).resolve().parent / "book" / "_ext" / "repository.py"
    spec = importlib.util.spec_from_file_location("_normlib_book_repository", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.repository_url()


url = _repository_url()
setup(project_urls={
    "Homepage": url,
    "Source": url,
    "Issues": f"{url}/issues",
    "Changelog": f"{url}/blob/main/CHANGELOG.md",
} if url else {})
