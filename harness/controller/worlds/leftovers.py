"""What a run leaves in the temporary folder, named by its owner so that nothing outlives it.

A controller killed by SIGKILL cannot clean up: its ranks die with it (their parent-death
signal), but the world's folder and multiprocessing's (the fork server's socket) stay. Every such
folder is named ``shardcheck-<what>-<pid>-...`` after the controller that made it, and each run
removes, before it starts a world, those whose owner is gone.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile

from shardcheck.harness.wire import process_alive

_OWNED = re.compile(r"^shardcheck-(world|mp)-(\d+)-")
# A Unix socket's path holds at most 107 bytes; the fork server's is this folder, "/listener-"
# and 8 random characters
_SOCKET_FOLDER_MAX = 107 - len("/listener-") - 8 - 8
# where the fork server listens when TMPDIR is too long for a socket (a pytest-xdist worker's
# tmp_path is): Python 3.11's multiprocessing would put its own folder under TMPDIR and fail
_SHORT_ROOTS = ("/tmp", "/var/tmp", "/dev/shm")


def owned_folder(what: str, root: str | None = None) -> str:
    """A new folder in ``root`` (the temporary folder by default), named after this process."""
    return tempfile.mkdtemp(prefix=f"shardcheck-{what}-{os.getpid()}-", dir=root)


def multiprocessing_folder() -> None:
    """multiprocessing's own temporary folder (where the fork server listens) named after this
    process, before multiprocessing makes an anonymous ``pymp-*`` one; removed at exit."""
    from multiprocessing import process

    config = process.current_process()._config
    if config.get("tempdir") is not None:
        return
    for root in (None, *_SHORT_ROOTS):
        try:
            folder = owned_folder("mp", root)
        except OSError:
            continue
        if len(folder) <= _SOCKET_FOLDER_MAX:
            config["tempdir"] = folder
            atexit.register(shutil.rmtree, folder, True)
            return
        os.rmdir(folder)  # the server's socket path would pass the kernel's limit
    raise OSError(f"no folder for the fork server's socket: TMPDIR={tempfile.gettempdir()!r} is too long for a "
                  f"Unix socket and none of {', '.join(_SHORT_ROOTS)} can be written")


def sweep(root: str | None = None) -> list[str]:
    """Remove the folders of runs whose controller is gone (this user's only) from ``root`` (by
    default the temporary folder and the short folders a fork server may listen in); the names
    removed."""
    if root is None:
        roots = dict.fromkeys([os.path.realpath(r) for r in (tempfile.gettempdir(), *_SHORT_ROOTS) if os.path.isdir(r)])
        return [name for r in roots for name in sweep(r)]
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        m = _OWNED.match(name)
        if m is None or process_alive(int(m.group(2))):
            continue
        path = os.path.join(root, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    return removed
