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
# and 8 random characters (a longer TMPDIR keeps multiprocessing's own, shorter, folder name)
_SOCKET_FOLDER_MAX = 107 - len("/listener-") - 8 - 8


def owned_folder(what: str) -> str:
    """A new folder in the temporary folder, named after this process."""
    return tempfile.mkdtemp(prefix=f"shardcheck-{what}-{os.getpid()}-")


def multiprocessing_folder() -> None:
    """multiprocessing's own temporary folder (where the fork server listens) named after this
    process, before multiprocessing makes an anonymous ``pymp-*`` one; removed at exit."""
    from multiprocessing import process

    config = process.current_process()._config
    if config.get("tempdir") is None:
        folder = owned_folder("mp")
        if len(folder) > _SOCKET_FOLDER_MAX:  # the server's socket path would pass the kernel's limit
            os.rmdir(folder)
            return
        config["tempdir"] = folder
        atexit.register(shutil.rmtree, folder, True)


def sweep(root: str | None = None) -> list[str]:
    """Remove the folders of runs whose controller is gone (this user's only); the names removed."""
    root = root or tempfile.gettempdir()
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
