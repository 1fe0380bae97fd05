"""Files the user names: outputs checked before any work starts and written atomically, inputs
read with a one-line error naming the file and what is wrong."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable

from specgraph.errors import SpecgraphError


def check_output(path: Path, flag: str) -> None:
    """Refuse, before any work, an output path that cannot be written: its folder missing, the path
    a folder, or no permission."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise SpecgraphError(f"{flag}: {path} is a folder; give a file path")
    if not folder.is_dir():
        raise SpecgraphError(f"{flag}: folder {folder} does not exist; create it or write elsewhere")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise SpecgraphError(f"{flag}: {path} cannot be written (no permission)")


def write_atomically(path: Path, write: Callable[[Path], None] | str) -> None:
    """Write `path` through a temporary file in its folder, then rename it into place, so a failed
    write never leaves half a file or destroys the old one. `write`: text, or a function that
    writes the given temporary path."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(handle)
    try:
        if isinstance(write, str):
            Path(temporary).write_text(write)
        else:
            write(Path(temporary))
        os.replace(temporary, path)
    except OSError as exc:
        raise SpecgraphError(f"{path}: cannot be written ({exc.strerror or exc})") from None
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def read_text(path: Path, what: str) -> str:
    """The file's text (UTF-8), or a one-line error naming it."""
    path = Path(path)
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
