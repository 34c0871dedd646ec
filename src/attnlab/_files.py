"""Atomic writes: a file or a folder either appears whole under its name, or not at all.

The one writer of every file attnlab produces that a user keeps (checkpoints, model
folders, results, plots, embeddings). Each is written under a temporary name beside its
destination, flushed to disk (``fsync``), then renamed over the destination (``rename``
is atomic within a file system), and the parent folder is synced so that the rename
itself survives a crash. A process killed at any moment leaves either the old content or
the new one, plus at most a hidden ``.NAME.tmp-*`` leftover that the next write removes.

Torch-free: library code passes a callback that writes into the temporary path
(``safetensors.save_file(..., path)``, ``fig.savefig(path)``) where a writer needs a path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "atomic_folder",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "fsync_tree",
    "is_temporary",
    "writable_dir",
    "writable_file",
]

_TMP = ".tmp-"


def is_temporary(path: str | Path) -> bool:
    """Whether ``path`` is one of this module's temporary names (``.NAME.tmp-*``)."""
    name = Path(path).name
    return name.startswith(".") and _TMP in name


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - a platform without directory descriptors
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on folders
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: str | Path) -> None:
    """``fsync`` every file under ``folder``, then every folder, deepest first."""
    root = Path(folder)
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _temporary(dest: Path, tag: str) -> Path:
    return dest.with_name(f".{dest.name}{_TMP}{tag}")


def atomic_write(dest: str | Path, write: Callable[[Path], object]) -> Path:
    """Write the file ``dest`` atomically: ``write(tmp)`` writes a temporary path.

    Args:
        dest: the file to create or replace.
        write: called with the temporary path (in ``dest``'s folder) to write to.

    Returns:
        ``dest`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: the folder is missing or unwritable (nothing is left behind).
    """
    dest = Path(dest)
    tmp = _temporary(dest, str(os.getpid()))
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(dest.parent)
    return dest


def atomic_write_bytes(dest: str | Path, data: bytes) -> Path:
    """Write ``data`` to the file ``dest`` atomically (see :func:`atomic_write`)."""
    return atomic_write(dest, lambda p: p.write_bytes(data))


def atomic_write_text(dest: str | Path, text: str, *, encoding: str = "utf-8") -> Path:
    """Write ``text`` to the file ``dest`` atomically (see :func:`atomic_write`)."""
    return atomic_write(dest, lambda p: p.write_text(text, encoding=encoding))


@contextlib.contextmanager
def atomic_folder(dest: str | Path, *, tag: str | None = None) -> Iterator[Path]:
    """Build the folder ``dest`` atomically: fill the yielded temporary folder.

    On a clean exit the temporary folder is synced and renamed to ``dest``; an existing
    ``dest`` is first moved aside under a temporary name and removed after the rename, so
    a crash in between leaves the old copy (under that name) and never a half-written
    ``dest``. On an exception the temporary folder is removed and ``dest`` is untouched.

    Args:
        dest: the folder to create or replace.
        tag: the temporary folder's suffix; processes that fill one folder together (a
            distributed checkpoint) pass the same tag. Default: this process's id.

    Raises:
        OSError: the parent folder cannot be created or written.
        ValueError: ``dest`` is the working folder, one of its parents, or the home folder.
    """
    dest = Path(dest)
    here = Path.cwd().resolve()
    if dest.resolve() in (here, *here.parents, Path.home().resolve()):
        raise ValueError(
            f"{str(dest)!r} would replace the working folder, one of its parents or the home "
            "folder; give a folder of its own"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(dest, tag or str(os.getpid()))
    if tmp.exists():  # a leftover of a killed write with the same tag
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        replace_folder(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_folder(tmp: Path, dest: Path) -> None:
    """Rename the complete folder ``tmp`` to ``dest``, replacing (and removing) an old one."""
    old: Path | None = None
    if dest.exists():
        old = _temporary(dest, f"old-{os.getpid()}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(dest, old)
    os.replace(tmp, dest)
    _fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def writable_dir(arg: str, path: str | Path) -> Path:
    """Create the output folder ``path`` (given as argument ``arg``) or fail naming both.

    Raises:
        OSError: the folder cannot be created or written; the message names ``arg``.
    """
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".attnlab-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OSError(
            e.errno, f"{arg} {str(path)!r} is not a writable folder: {e.strerror}"
        ) from None
    return folder


def writable_file(arg: str, path: str | Path) -> Path:
    """Check that the output file ``path`` (argument ``arg``) can be written, before work starts.

    Raises:
        OSError: its folder is missing or not writable, or it names a folder.
    """
    file = Path(path)
    parent = file.parent
    if file.is_dir():
        raise OSError(21, f"{arg} {str(path)!r} is a folder; give a file name")
    if not parent.is_dir():
        raise OSError(2, f"{arg} {str(path)!r}: the folder {str(parent)!r} does not exist")
    existed = file.exists()
    try:
        with file.open("ab"):
            pass
    except OSError as e:
        raise OSError(e.errno, f"{arg} {str(path)!r} cannot be written: {e.strerror}") from None
    if not existed:
        file.unlink()
    return file
