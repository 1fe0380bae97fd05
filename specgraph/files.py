"""Files the user names: outputs checked before any work starts and written where the user means
them, inputs read with a one-line error naming the file and what is wrong."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import sys
from pathlib import Path
from typing import BinaryIO, Callable

from specgraph.errors import SpecgraphError


def _mode(path: Path) -> int | None:
    """The st_mode of what `path` names, through any symlinks; None where nothing is there yet."""
    try:
        return os.stat(path).st_mode
    except FileNotFoundError:
        return None


def _target(path: Path) -> Path:
    """The file `path` names, through any symlinks (a dangling one names the file it would create):
    the place to rename onto, so that the link stays a link."""
    return Path(os.path.realpath(path))


def _create_beside(target: Path) -> tuple[int, Path]:
    """A new empty file `.NAME.RANDOM` in `target`'s folder, open for writing, created as any tool
    creates a file: mode 0666 less the umask (mkstemp's is 0600)."""
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(8)}")
    return os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), temporary


STDOUT = "-"  # an output path that means standard output
_data_out = None  # where write_output(STDOUT) writes while data_on_stdout() holds; else sys.stdout


@contextlib.contextmanager
def data_on_stdout():
    """Within it, what a command prints goes to standard error and only what write_output(STDOUT)
    writes goes to standard output: `--json -` gives a pipe the JSON alone."""
    global _data_out
    _data_out = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _data_out = None


def check_output(path: Path, flag: str) -> None:
    """Refuse in one line, before any work, an output path that `write_output` cannot write. Tried,
    not guessed from the name: for a file (new or not) a temporary file is created and removed
    where the output will be renamed into place, so that the OS gives its reason (a missing folder,
    a parent that is a file, a read-only folder or filesystem, /proc); a FIFO or character device
    is only checked for write permission, as opening a FIFO to write blocks until a reader comes.
    `-` is standard output."""
    if str(path) == STDOUT:
        return
    path = Path(path)
    try:
        mode = _mode(path)
        if mode is None or stat.S_ISREG(mode):
            handle, temporary = _create_beside(_target(path))
            os.close(handle)
            os.unlink(temporary)
    except OSError as exc:
        raise SpecgraphError(f"{flag}: {path} cannot be written ({exc.strerror or exc}); "
                             "give a path in a folder you can write") from None
    if mode is None:
        return
    if stat.S_ISDIR(mode):
        raise SpecgraphError(f"{flag}: {path} is a folder; give a file path")
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
        raise SpecgraphError(f"{flag}: {path} is neither a file, a FIFO nor a character device; give a file path")
    if not os.access(path, os.W_OK):
        raise SpecgraphError(f"{flag}: {path} cannot be written (no permission)")


def write_output(path: Path, content: str | Callable[[BinaryIO], None]) -> None:
    """Write `content` (text, or a function that writes to the binary file it is given) to what
    `path` names: a FIFO or character device is opened and written in place (a rename would
    replace it); a file, through any symlinks, is written atomically: a temporary file beside it is
    renamed onto it, so a failed write leaves no half file and the old one whole. A new file gets
    the mode the umask gives, a replaced one keeps its mode. A failed write is one line. `-` is
    standard output."""
    fill = content if callable(content) else lambda f: f.write(content.encode("utf-8"))
    if str(path) == STDOUT:
        out = _data_out or sys.stdout
        out.flush()
        fill(out.buffer)
        out.buffer.flush()
        return
    path = Path(path)
    try:
        mode = _mode(path)
        if mode is not None and not stat.S_ISREG(mode):
            with open(path, "wb") as f:
                fill(f)
            return
        target = _target(path)
        handle, temporary = _create_beside(target)
        try:
            with os.fdopen(handle, "wb") as f:
                fill(f)
            if mode is not None:
                os.chmod(temporary, stat.S_IMODE(mode))
            os.replace(temporary, target)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as exc:
        raise SpecgraphError(f"{path}: cannot be written ({exc.strerror or exc})") from None


def read_text(path: Path, what: str) -> str:
    """The file's text (UTF-8), or a one-line error naming it."""
    path = Path(path)
    if path.is_dir():
        raise SpecgraphError(f"{what}: {path} is a folder; give a file")
    if not path.is_file():
        raise SpecgraphError(f"{what}: {path} does not exist")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SpecgraphError(f"{what}: {path} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise SpecgraphError(f"{what}: {path} cannot be read ({exc.strerror or exc})") from None


def read_json(path: Path, what: str):
    try:
        return json.loads(read_text(path, what))
    except json.JSONDecodeError as exc:
        raise SpecgraphError(f"{what}: {path} is not JSON ({exc.msg}, line {exc.lineno})") from None
