"""One gloo transport device for every process group of a rank the controller started.

torch gives each gloo process group a TCP device of its own, and each device an event-loop thread
that wakes every 10 ms (gloo's ``epoll_wait`` timeout) whether or not anything arrives.
megatron-core builds about 17 groups a layout, and a world keeps the groups of every layout it has
run: a 4-rank world that has seen six layouts holds 86 groups a rank, 344 threads waking 34,000
times a second. On 2 cores that was 0.2 of the machine with the world idle (a test suite's shared
world is idle while other tests run), and more under load.

Here every group of the rank shares one device, so one loop thread serves every pair. The groups
are the same groups (same backend name, ranks, timeouts, worker threads, algorithms): a device is
only where a group's sockets live, and gloo's device serves any number of contexts. torch builds
the per-group device inside ``ProcessGroupGloo``'s constructor, with no option to pass one in
through ``new_group``; so the class that ``distributed_c10d`` constructs is a subclass that hands
the shared device to the constructor's options form. ``isinstance`` checks against torch's class
still hold.

Left as torch does it: a world whose ranks bind to interfaces named in ``GLOO_SOCKET_IFNAME``
(torch then builds a device per interface), and any world with ``SHARDCHECK_GLOO_DEVICES=per-group``
(to rule the harness out when a result looks like its doing).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping

ENV = "SHARDCHECK_GLOO_DEVICES"
_shared: bool = False


def wanted(environment: Mapping[str, str]) -> bool:
    """Whether a rank with this environment shares one device (see the module's docstring)."""
    return environment.get(ENV, "shared") != "per-group" and not environment.get("GLOO_SOCKET_IFNAME")


def share() -> None:
    """From now on, every gloo group this process builds uses one device (made here)."""
    global _shared
    if _shared:
        return
    from torch.distributed import distributed_c10d as c10d

    torch_class = c10d.ProcessGroupGloo
    device = torch_class.create_default_device()  # honours TORCH_GLOO_LAZY_INIT as torch's own does

    class SharedDeviceProcessGroupGloo(torch_class):  # type: ignore[misc, valid-type]
        def __init__(self, store, rank: int, size: int,  # noqa: ANN001
                     timeout: datetime.timedelta = datetime.timedelta(seconds=1800)) -> None:
            options = torch_class._Options()
            options._devices = [device]
            options._timeout = timeout
            options._threads = 2  # what torch's constructor gives one device
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceProcessGroupGloo
    _shared = True


def loop_threads(pid: int) -> int | None:
    """How many gloo event-loop threads process ``pid`` runs (Linux; None elsewhere)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    count = 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                count += f.read().strip() == "gloo_tcp_loop"
        except OSError:
            continue
    return count
