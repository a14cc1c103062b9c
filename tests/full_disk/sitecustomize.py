"""A disk that is full for the files named in $FULL_DISK (comma-separated names): once a file of that name is opened
for writing (os.open, then os.fdopen: how a run opens its own files; `.NAME.partial` too, where a file written whole
starts), its writes fail with ENOSPC, as on a full
disk. What a link to /dev/full did before a run refused to write through links. Imported at start-up by Python (the
`site` module) when this folder is on PYTHONPATH: the tests put it there for the runs they mean to fill."""

import os

_open, _fdopen, _marked = os.open, os.fdopen, set()


def _open_marking(path, flags, mode=0o777, *, dir_fd=None):
    fd = _open(path, flags, mode, dir_fd=dir_fd)
    names = set(filter(None, os.environ.get("FULL_DISK", "").split(",")))  # as it is now: a script may change it
    name = os.path.basename(os.fsdecode(path))  # a file written whole is written as .NAME.partial first
    if (name in names or name.removeprefix(".").removesuffix(".partial") in names) and flags & (os.O_WRONLY |
                                                                                                os.O_RDWR):
        _marked.add(fd)
    return fd


def _fdopen_full(fd, *args, **kwargs):
    if fd in _marked:  # after the caller's checks of the file: from now on every write finds the disk full
        _marked.discard(fd)
        full = _open("/dev/full", os.O_WRONLY)
        os.dup2(full, fd)
        os.close(full)
    return _fdopen(fd, *args, **kwargs)


if "FULL_DISK" in os.environ:
    os.open, os.fdopen = _open_marking, _fdopen_full
