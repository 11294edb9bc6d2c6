"""The convention every ``python -m normlib...`` command follows.

* **Arguments are checked before any work starts.** Each option has a type
  that refuses what the tool cannot use (:func:`int_at_least`,
  :func:`positive_float`, :func:`output_file`, :func:`spec`, ...), and the
  checks that involve several options run right after parsing, through
  ``parser.error``. Nothing is measured, spawned or written for a bad command.
* **A bad argument is one line** on standard error, naming the argument, what
  it allows and what came, e.g. ``python -m normlib.benchmark.host: error:
  argument --rounds: expected an integer >= 1, got '0' (see --help)``; the
  exit status is 2 (argparse's own convention) and there is no traceback.
* **Output files are written atomically** (:func:`write_text`): a temporary
  file in the target's folder, renamed over the target once complete, and
  removed if anything fails, so an interrupted or failed run leaves the last
  whole file, or none, and nothing beside it.

The tools import this module; the library never does.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
from typing import Callable, Iterable, Iterator, NoReturn, Optional, Sequence

__all__ = [
    "Parser",
    "int_at_least",
    "positive_float",
    "output_file",
    "input_file",
    "spec",
    "write_text",
]


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line and exit with status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _typed(name: str, fn: Callable[[str], object]) -> Callable[[str], object]:
    fn.__name__ = name  # argparse names the type in some messages
    return fn


def int_at_least(low: int, high: Optional[int] = None) -> Callable[[str], int]:
    """An argparse type: an integer ``>= low`` (and ``<= high`` when given)."""
    allowed = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")
        return value

    return _typed(f"int_at_least_{low}", parse)  # type: ignore[return-value]


def positive_float(high: Optional[float] = None) -> Callable[[str], float]:
    """An argparse type: a finite number ``> 0`` (and ``<= high`` when given)."""
    allowed = "a finite number > 0" if high is None else f"a number > 0 and <= {high:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        if not (math.isfinite(value) and value > 0) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")
        return value

    return _typed("positive_float", parse)  # type: ignore[return-value]


def output_file(suffixes: Sequence[str] = ()) -> Callable[[str], str]:
    """An argparse type: a file the tool may write, checked before any work starts.

    The path must not be a folder, its folder must exist and be writable, an
    existing file there must be writable, and (when ``suffixes`` is given) its
    name must end in one of them. Nothing is created by the check.
    """

    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError("expected a file name, got ''")
        if suffixes and not text.lower().endswith(tuple(suffixes)):
            raise argparse.ArgumentTypeError(f"expected a file name ending in {' or '.join(suffixes)}, got {text!r}")
        if os.path.isdir(text):
            raise argparse.ArgumentTypeError(f"expected a file to write, got the folder {text!r}")
        target = _target(text)  # a symbolic link is written through: its target is what must be writable
        if target != text and os.path.isdir(target):
            raise argparse.ArgumentTypeError(f"expected a file to write, got a link to the folder {target!r}")
        folder = os.path.dirname(os.path.abspath(target))
        longest = _name_max(folder)
        if len(os.fsencode(os.path.basename(text))) > longest:
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: its name is longer than the {longest} "
                                             "bytes this folder allows")
        if not os.path.isdir(folder):
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: its folder {folder!r} does not exist")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: its folder {folder!r} is not writable")
        if os.path.exists(text) and not os.access(text, os.W_OK):
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: the file is not writable")
        return text

    return _typed("output_file", parse)  # type: ignore[return-value]


def _name_max(folder: str) -> int:
    """The longest file name ``folder``'s file system takes, in bytes (255 where it cannot be asked)."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (AttributeError, OSError, ValueError):
        return 255


def _target(path: str) -> str:
    """Where writing ``path`` lands: a symbolic link's target (the link stays a link), else ``path``."""
    return os.path.realpath(path) if os.path.islink(path) else path


def input_file(suffixes: Sequence[str] = ()) -> Callable[[str], str]:
    """An argparse type: an existing, readable file (ending in one of ``suffixes`` when given)."""

    def parse(text: str) -> str:
        if suffixes and not text.lower().endswith(tuple(suffixes)):
            raise argparse.ArgumentTypeError(f"expected a file name ending in {' or '.join(suffixes)}, got {text!r}")
        if not os.path.isfile(text):
            raise argparse.ArgumentTypeError(f"expected an existing file, got {text!r}")
        if not os.access(text, os.R_OK):
            raise argparse.ArgumentTypeError(f"cannot read {text!r}")
        return text

    return _typed("input_file", parse)  # type: ignore[return-value]


def spec(form: str, fields: Iterable[Callable[[str], object]]) -> Callable[[str], tuple]:
    """An argparse type: ``a:b:...``, each field parsed (and checked) by its own function.

    ``form`` is how the help and the errors spell the format (``"dtype:kind:N"``);
    each field function raises ``ValueError`` with the allowed values when its
    field is wrong.
    """
    parsers = list(fields)

    def parse(text: str) -> tuple:
        parts = text.split(":")
        if len(parts) != len(parsers):
            raise argparse.ArgumentTypeError(f"expected {form} ({len(parsers)} fields separated by ':'), got {text!r}")
        out = []
        for name, part, fn in zip(form.split(":"), parts, parsers):
            try:
                out.append(fn(part))
            except (ValueError, argparse.ArgumentTypeError) as e:
                raise argparse.ArgumentTypeError(f"{text!r}: the field {name} {e}") from None
        return tuple(out)

    return _typed("spec", parse)  # type: ignore[return-value]


def one_of(values: Sequence[str]) -> Callable[[str], str]:
    """A field of :func:`spec`: one of ``values``."""

    def parse(text: str) -> str:
        if text not in values:
            raise ValueError(f"must be one of {', '.join(values)} (got {text!r})")
        return text

    return parse


def field_int(low: int, high: Optional[int] = None) -> Callable[[str], int]:
    """A field of :func:`spec`: an integer ``>= low`` (and ``<= high``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"from {low} to {high}"
            raise ValueError(f"must be an integer {bound} (got {text!r})")
        return value

    return parse


def _mode_for(path: str) -> int:
    """The permissions ``path`` keeps (or a new file gets under the umask): a temporary file starts at 0600."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def _replacing(path: str, suffix: str = ".tmp") -> Iterator[str]:
    """A temporary file beside ``path`` to write; renamed over ``path`` when the block ends, removed if it fails.

    A symbolic link is written through (its target is replaced; the link
    stays); the file keeps ``path``'s permissions, or gets the umask's.
    """
    path = _target(path)
    mode = _mode_for(path)
    # a short name: any name that fits the folder, fits with it
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".normlib-", suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a temporary file beside it, renamed over it when complete.

    If writing fails, the temporary file is removed and the error raised; an
    existing ``path`` is left as it was. A symbolic link is written through
    (its target is replaced; the link stays).
    """
    with _replacing(path) as tmp, open(tmp, "w") as f:
        f.write(text)


def save_figure(fig, path: str, **kwargs) -> None:
    """``fig.savefig`` to ``path`` atomically (the format from ``path``'s suffix)."""
    suffix = os.path.splitext(path)[1]
    with _replacing(path, suffix) as tmp:
        fig.savefig(tmp, format=suffix.lstrip(".").lower() or None, **kwargs)


def fail(prog: str, message: str, status: int = 2) -> int:
    """Print ``prog: message`` on standard error (one line) and return ``status``, for a tool's ``main``."""
    import sys

    print(f"{prog}: {message}", file=sys.stderr)
    return status
