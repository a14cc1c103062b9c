"""The run's folders, each held by a handle (a descriptor of the folder, O_DIRECTORY): what the run makes, opens,
moves or removes in one is found there, whatever is renamed or replaced by a link meanwhile, never through a
symbolic link (O_NOFOLLOW); a file it writes is a new one (O_EXCL), so that neither a symbolic nor a hard link
planted under its name is written through. Files a library writes by path (transformers' save_pretrained, the
tokenizer's, peft's) go into a private folder of the run's first and are then linked into place, never over a name
that is taken.
"""

import contextlib
import errno
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Optional

from .errors import inert

__all__ = ["Folder"]  # given as plumbing.NAME to rloo_multinode.py; tests import the rest from the module

DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class FolderMoved(OSError):
    """A folder of the run's is no longer the one it started with: renamed, moved, removed or replaced by a link."""


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class Folder:
    """A folder held by a handle. `path` names it in messages (and for what reads by path); `fd` is the handle.
    Created by Folder.at (a path as the user gave it: links in it followed) or by .folder (one name in a held
    folder, never through a link but where `follow` says so). Close it (or use it in a `with`)."""

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, Path(path)

    @classmethod
    def at(cls, path, identity: Optional[tuple] = None, create: bool = False) -> "Folder":
        """The folder at `path`, the links on the way followed (output_dir may be a link, or lie under one); made if
        `create` (its parents too). With `identity` (an earlier Folder's .identity), a folder that is not that one
        (renamed, moved, removed or replaced since) raises FolderMoved, and none is made."""
        path = Path(path)
        if create and identity is None:
            path.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, DIRECTORY)
        except (FileNotFoundError, NotADirectoryError) as e:
            if identity is not None:
                raise FolderMoved(e.errno, f"{inert(path, 200)} is gone (renamed, moved or removed while the run "
                                           "wrote it)") from None
            raise
        folder = cls(fd, path)
        if identity is not None and folder.identity != identity:
            folder.close()
            raise FolderMoved(errno.ESTALE, f"{inert(path, 200)} is no longer the folder the run started with "
                                            "(renamed, moved or replaced while the run wrote it)")
        return folder

    @property
    def identity(self) -> tuple:
        info = os.fstat(self.fd)
        return info.st_dev, info.st_ino

    @property
    def os_path(self) -> str:
        """A path naming this very folder, for a library that takes a path: /proc/self/fd/<handle> where there is
        one (Linux), so that renaming or replacing anything above it changes nothing; else its path."""
        by_handle = f"/proc/self/fd/{self.fd}"
        return by_handle if os.path.isdir(by_handle) else str(self.path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Folder":
        return self

    def __exit__(self, *_) -> None:
        self.close()

    # ---- what it holds
    def lstat(self, name: str) -> Optional[os.stat_result]:
        """The entry `name` itself (a link is not followed), or None if there is none."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def entries(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def is_link(self, name: str) -> bool:
        info = self.lstat(name)
        return info is not None and stat.S_ISLNK(info.st_mode)

    def is_folder(self, name: str) -> bool:
        info = self.lstat(name)
        return info is not None and stat.S_ISDIR(info.st_mode)

    def folder(self, name: str, create: bool = False, mode: int = 0o777, follow: bool = False) -> "Folder":
        """The folder `name` in this one, made (with `mode`, less the umask) if `create` and missing; a symbolic link
        there is refused (OSError ELOOP) unless `follow` (output_dir/checkpoints may be a link to another disk)."""
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, mode, dir_fd=self.fd)
        try:
            fd = os.open(name, DIRECTORY | (0 if follow else os.O_NOFOLLOW), dir_fd=self.fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR) and self.is_link(name):
                raise OSError(errno.ELOOP, f"{inert(self.path / name, 200)} is a symbolic link, which a run never "
                                           "follows") from None
            raise
        return Folder(fd, self.path / name)

    def new_folder(self, name: str, mode: int = 0o700) -> "Folder":
        """A folder made here now (FileExistsError if the name is taken), private (mode 0o700) unless `mode` says."""
        os.mkdir(name, mode, dir_fd=self.fd)
        return self.folder(name)

    def private(self, prefix: str) -> "Folder":
        """A new folder of a random name (`prefix` and 16 hex digits), mode 0o700: no other account can put anything
        in it, and no path names it before it exists."""
        return self.new_folder(f"{prefix}{secrets.token_hex(8)}")

    # ---- files
    def create(self, name: str, binary: bool = True, mode: int = 0o666):
        """A new file `name` to write (O_EXCL: FileExistsError if anything is there, a link included)."""
        fd = os.open(name, NEW_FILE, mode, dir_fd=self.fd)
        return os.fdopen(fd, "wb" if binary else "w")

    def write(self, name: str, data: str | bytes) -> None:
        """A file written whole: into a new `.NAME.partial` (the debris of an earlier attempt removed first), then
        renamed over `name`, which replaces the name (a link there, never followed); a reader never sees half."""
        partial = f".{name}.partial"
        self.unlink(partial)
        with self.create(partial, binary=isinstance(data, bytes)) as f:
            f.write(data)
        os.replace(partial, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def append(self, name: str, mode: str = "a", unshared: bool = False):
        """The run's own file `name` opened to append to ('a'; 'a+' to read it too), made if missing: never through a
        symbolic link, never a FIFO or a device; a file that also has another name (a hard link: a backup made with
        `cp -al`, say) is first copied to a file of its own under its name (once: `unshared`), so that the other name
        keeps its bytes."""
        flags = {"a": os.O_WRONLY, "a+": os.O_RDWR}[mode] | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = open_flags(self.path / name, name, flags | os.O_CLOEXEC, self.fd)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise OSError(errno.EPERM, f"{inert(self.path / name, 200)} is not a regular file")
        if info.st_nlink > 1 and not unshared:
            os.close(fd)
            self.unshare(name)
            return self.append(name, mode, unshared=True)
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode)

    def unshare(self, name: str) -> None:
        """The file `name`, which has other names (hard links), replaced by a copy of its own: the other names keep
        the old file, unchanged by what the run writes next."""
        with self.open_read(name) as source:
            self.write(name, source.read())

    def open_read(self, name: str):
        fd = open_flags(self.path / name, name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, self.fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EPERM, f"{inert(self.path / name, 200)} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")

    def copy_from(self, source: "Folder", name: str) -> None:
        """A new file `name` here holding the bytes of `source`'s `name` (where a hard link cannot be made)."""
        with source.open_read(name) as f, self.create(name) as out:
            shutil.copyfileobj(f, out, 1 << 24)

    # ---- names
    def unlink(self, name: str) -> None:
        """The entry `name` removed if it is a file or a link (a link itself, never what it points to)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def remove_tree(self, name: str) -> None:
        """The entry `name` removed: a link or a file by its name, a folder with everything in it, never following a
        link inside (shutil.rmtree through handles)."""
        info = self.lstat(name)
        if info is None:
            return
        if not stat.S_ISDIR(info.st_mode):
            return self.unlink(name)
        shutil.rmtree(name, dir_fd=self.fd)

    def move(self, name: str, to: "Folder", new_name: Optional[str] = None) -> None:
        """`name` renamed into `to` as `new_name` (its own name by default): a name that is taken there is an error
        (FileExistsError), never replaced."""
        new_name = new_name or name
        if to.lstat(new_name) is not None:
            raise FileExistsError(errno.EEXIST, f"{inert(to.path / new_name, 200)} exists")
        os.rename(name, new_name, src_dir_fd=self.fd, dst_dir_fd=to.fd)

    def link(self, name: str, to: "Folder", new_name: Optional[str] = None) -> None:
        """A second name for the file `name` in `to` (a hard link; a taken name is FileExistsError, never replaced)."""
        os.link(name, new_name or name, src_dir_fd=self.fd, dst_dir_fd=to.fd, follow_symlinks=False)

    def chmod(self, name: Optional[str] = None, mode: Optional[int] = None) -> None:
        """This folder (or its file `name`, never through a link) given `mode`, by default what the umask gives a
        new folder (or file)."""
        if name is None:
            os.fchmod(self.fd, 0o777 & ~umask() if mode is None else mode)
            return
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            os.fchmod(fd, 0o666 & ~umask() if mode is None else mode)
        finally:
            os.close(fd)

    def strange_entries(self, recursive: bool = True) -> list[str]:
        """The entries that are neither regular files with one name nor folders (with `recursive`, at any depth):
        what a library writing here left, or what was planted while it wrote (a symbolic or a hard link)."""
        found = []
        for name in self.entries():
            info = self.lstat(name)
            if info is None:
                continue
            if stat.S_ISDIR(info.st_mode):
                if recursive:
                    with self.folder(name) as inner:
                        found += [f"{name}/{entry}" for entry in inner.strange_entries()]
            elif not stat.S_ISREG(info.st_mode):
                found.append(f"{name} (a symbolic link)" if stat.S_ISLNK(info.st_mode) else f"{name} (not a file)")
            elif info.st_nlink > 1:
                found.append(f"{name} (a hard link: {info.st_nlink} names)")
        return found

    def adopt(self, private: "Folder", mode: Optional[int] = None) -> list[str]:
        """Every file a library wrote into `private` (a folder made by .private) linked into this folder under its
        name, then `private` emptied: each one first checked (a regular file with one name: nothing planted), given
        the umask's mode (safetensors writes 0600), and never put over a name that is taken here. Returns the
        names. OSError naming what is wrong."""
        strange = private.strange_entries(recursive=False)
        folders = [n for n in private.entries() if private.is_folder(n)]
        if strange or folders:
            raise OSError(errno.EPERM, f"{inert(private.path, 200)} holds {(strange + folders)[0]}, which the run "
                                       "did not write: something else writes in the run's folders")
        names = private.entries()
        for name in names:
            private.chmod(name, mode)
            try:
                private.link(name, self)
            except OSError as e:
                if e.errno in (errno.EEXIST,):
                    raise OSError(errno.EEXIST, f"{inert(self.path / name, 200)} appeared while the run wrote it "
                                                "(not the run's): something else writes in the run's folders") from None
                self.copy_from(private, name)  # a filesystem without hard links
            private.unlink(name)
        return names


def open_flags(path: Path, name: str, flags: int, dir_fd: int, mode: int = 0o666) -> int:
    """os.open of `name` in the folder `dir_fd`, a symbolic link or a FIFO without a reader said in words."""
    try:
        return os.open(name, flags, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{inert(path, 200)} is a symbolic link, which a run never writes through"
                          ) from None
        if e.errno == errno.ENXIO:  # a FIFO without a reader, a device without its driver
            raise OSError(errno.ENXIO, f"{inert(path, 200)} is not a regular file") from None
        raise


def own_file_system():
    """torch.distributed.checkpoint's file system (its FileSystem), writing only new files (O_EXCL, never through a
    link): what the optimizer's shards are written with, in a folder the run made."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class OwnFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode: str):
            if "r" in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with os.fdopen(os.open(path, NEW_FILE, 0o666), mode) as stream:
                yield stream

        def mkdir(self, path) -> None:  # the run made it
            if not os.path.isdir(path):
                raise FileNotFoundError(errno.ENOENT, f"{inert(path, 200)} is not a folder the run made")

    return OwnFileSystem()
