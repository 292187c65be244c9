"""Writing a run's outputs when the disk fails them: full, read-only, or gone during the run.

Every output is written under a temporary name and renamed when complete (:func:`write_text`; checkpoints and
``model/`` as folders), so a failed write never leaves a file or folder that looks complete. A write that fails
because the filesystem is full, read-only or no longer there raises :class:`WriteFailed` (the CLI exits 5) with one
line naming the folder, the space needed and the space free; the partial temporary file or folder is removed
first, so the space it held is free again (on a filesystem turned read-only it cannot be: the line says so, and the
next run removes it). Any other failure propagates unchanged: a bug is not reported as a disk.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, Optional

# A write that failed with less than this free (or than the bytes it needed) failed for want of space: torch's zip
# writer and safetensors report a full disk in words of their own ("unexpected pos", "StorageFull"), not ENOSPC.
SLACK_BYTES = 1 << 20
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
PARTIAL = ".tmp_"  # the prefix of a file or folder being written (and of a complete one being replaced: .old_)
REPLACED = ".old_"


class WriteFailed(Exception):
    """An output could not be written (no space, read-only, vanished): the CLI exits with status 5."""


def size_text(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(size) < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _existing(path: Path) -> Path:
    """``path`` or the nearest folder above it that exists (a filesystem to ask about)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def unwritable(folder: Path) -> Optional[str]:
    """Why nothing can be written into ``folder`` (or where it would be created), or None."""
    where = _existing(folder)
    if not os.access(where, os.W_OK | os.X_OK):  # also false for root on a read-only filesystem (EROFS)
        return f"{where} is not writable (a read-only filesystem, or no permission)"
    return None


def problem(folder: Path, error: BaseException, needed: Optional[int]) -> Optional[str]:
    """What about the disk made writing into ``folder`` fail with ``error``, or None when it was not the disk."""
    code = getattr(error, "errno", None)
    if not folder.exists():
        return f"{folder} no longer exists (removed while the run was writing into it)"
    why = unwritable(folder)
    if why or code in READ_ONLY:
        return why or f"{folder} is not writable ({os.strerror(code)})"
    free = shutil.disk_usage(folder).free
    if code in FULL or free < max(needed or 0, SLACK_BYTES):
        need = f"about {size_text(needed)} needed, " if needed else ""
        return f"no space left on its device ({need}{size_text(free)} free)"
    return None


@contextmanager
def writing(what: str, folder: Path, needed: Optional[int] = None, partial: Optional[Path] = None) -> Iterator[None]:
    """Write ``what`` into ``folder``: a failure for want of space, of permission or of the folder itself becomes
    WriteFailed naming them, after removing ``partial`` (the temporary file or folder being written)."""
    try:
        yield
    except WriteFailed:
        raise
    except Exception as e:  # torch's zip writer, safetensors and Python's own files each raise their own kind
        found = problem(folder, e, needed)  # before removing the partial write: the free space it took counts
        left = ""
        if partial is not None:
            remove(partial)
            left = (f"; its partial write {partial.name} could not be removed (the next run removes it)"
                    if partial.exists() else "; its partial write was removed")
        if found is None:
            raise
        raise WriteFailed(f"cannot write {what} into {folder}: {found}{left}") from None


def remove(path: Path) -> None:
    """Remove a file or folder if it is there, as far as the filesystem lets (a read-only one: not at all)."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass


def remove_partial(folder: Path) -> None:
    """Clear what a run stopped mid-write left in ``folder``: temporary files and folders are removed; a complete
    one moved aside to be replaced is put back where the new one never arrived, else removed."""
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        if path.name.startswith(REPLACED) and not (folder / path.name[len(REPLACED):]).exists():
            os.replace(path, folder / path.name[len(REPLACED):])
        elif path.name.startswith((PARTIAL, REPLACED)):
            remove(path)


def write_text(path: Path, text: str) -> None:
    """Write to a temporary name, then rename: a reader (or a run stopped mid-write) never sees half a file."""
    tmp = path.with_name(f"{PARTIAL}{path.name}")
    with writing(path.name, path.parent, needed=len(text.encode()), partial=tmp):
        tmp.write_text(text)
        os.replace(tmp, path)


def write_json(path: Path, obj: Dict) -> None:
    write_text(path, json.dumps(obj, indent=2) + "\n")


def append_line(path: Path, line: str) -> None:
    """Append one line; a write that fails is cut off again, so the file never ends with half a line."""
    data = (line + "\n").encode()
    with writing(path.name, path.parent, needed=len(data)):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                while data:
                    data = data[os.write(fd, data):]
            except OSError:
                os.ftruncate(fd, start)
                raise
        finally:
            os.close(fd)
