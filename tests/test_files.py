"""Output paths (specgraph.files): written where the user means them (through a symlink to its
target, straight into a FIFO or character device, a file atomically with the mode any tool gives
it), and refused before any work, in one line with the OS's reason, where they cannot be written."""

import os
import socket
import stat
import threading
from pathlib import Path

import pytest
from helpers import character_device, read_fifo, unwritable_folder

from specgraph.errors import SpecgraphError
from specgraph.files import check_output, write_output


def leftovers(*folders: Path) -> list[str]:
    """Temporary files of a write (`.NAME.RANDOM`) left in `folders`."""
    return [p.name for folder in folders for p in folder.iterdir() if p.name.startswith(".")]


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target, link, dangling = elsewhere / "t.json", tmp_path / "link.json", tmp_path / "dangling.json"
    target.write_text("old")
    link.symlink_to(target)
    dangling.symlink_to(elsewhere / "new.json")
    for path in (link, dangling):
        check_output(path, "--json")
        write_output(path, f"through {path.name}")
    assert os.readlink(link) == str(target) and target.read_text() == "through link.json"
    assert os.readlink(dangling) == str(elsewhere / "new.json")
    assert (elsewhere / "new.json").read_text() == "through dangling.json"
    assert leftovers(tmp_path, elsewhere) == []


def test_a_character_device_is_written_into_not_replaced(tmp_path):
    device = character_device(tmp_path)
    before = os.stat(device)
    check_output(device, "--json")
    write_output(device, "x" * 100_000)
    after = os.lstat(device)
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    assert leftovers(tmp_path) == []


def test_a_write_error_is_one_line_and_the_device_stays(tmp_path):
    full = character_device(tmp_path, "full")
    check_output(full, "--json")  # it can be opened to write: only writing fails
    with pytest.raises(SpecgraphError) as error:
        write_output(full, "{}")
    assert str(error.value) == f"{full}: cannot be written (No space left on device)"
    assert stat.S_ISCHR(os.lstat(full).st_mode)


def test_a_fifo_is_checked_without_opening_it_and_written_into(tmp_path):
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    checked = threading.Thread(target=check_output, args=(fifo, "--json"), daemon=True)
    checked.start()  # with no reader: opening the FIFO to write would block
    checked.join(10)
    assert not checked.is_alive(), "check_output blocked on a FIFO"
    received = read_fifo(fifo)
    write_output(fifo, "through the FIFO")
    assert received() == b"through the FIFO" and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)], ids=["umask-022", "umask-027"])
def test_a_new_file_gets_the_umask_mode_and_a_replaced_one_keeps_its_own(tmp_path, umask, mode):
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    old.write_text("old")
    old.chmod(0o604)
    previous = os.umask(umask)
    try:
        write_output(new, "new")
        write_output(old, "replaced")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(new).st_mode) == mode and new.read_text() == "new"
    assert stat.S_IMODE(os.stat(old).st_mode) == 0o604 and old.read_text() == "replaced"


def test_a_failed_write_leaves_the_old_file_whole_and_no_temporary_file(tmp_path):
    out = tmp_path / "r.json"
    out.write_text("old")

    def fails(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(SpecgraphError, match="No space left on device"):
        write_output(out, fails)
    assert out.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_unwritable_places_are_refused_with_the_os_reason(tmp_path):
    afile = tmp_path / "a.txt"
    afile.write_text("mine")
    readonly, reason = unwritable_folder(tmp_path)
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    into_missing = tmp_path / "into-missing.json"
    into_missing.symlink_to(tmp_path / "missing" / "x.json")
    cases = [(afile / "x.json", "Not a directory"), (tmp_path / "missing" / "x.json", "No such file or directory"),
             (Path("/proc/x.json"), "No such file or directory"), (into_missing, "No such file or directory"),
             (readonly / "x.json", reason), (loop, "Too many levels of symbolic links")]
    for path, why in cases:
        with pytest.raises(SpecgraphError) as error:
            check_output(path, "--json")
        assert str(error.value) == f"--json: {path} cannot be written ({why}); give a path in a folder you can write"
    assert afile.read_text() == "mine" and os.readlink(into_missing) == str(tmp_path / "missing" / "x.json")
    assert leftovers(tmp_path, readonly) == []


def test_a_folder_or_socket_is_refused(tmp_path):
    folder, link = tmp_path / "folder", tmp_path / "link"
    folder.mkdir()
    link.symlink_to(folder)
    for path in (folder, link):
        with pytest.raises(SpecgraphError) as error:
            check_output(path, "--json")
        assert str(error.value) == f"--json: {path} is a folder; give a file path"
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(tmp_path / "s"))
        with pytest.raises(SpecgraphError, match="is neither a file, a FIFO nor a character device"):
            check_output(tmp_path / "s", "--json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "link", "s"] and list(folder.iterdir()) == []
