"""What the fork server imports once, so a rank forked from it starts without importing torch
and megatron-core again (on 2 cores that import is most of a world's start-up: 4 ranks importing
at once take about 6 s, forked ranks 0.1 s: ``benchmarks/world_start.py``).

Imported in the fork server only, never in the controller. It must not run a torch op: a
thread pool started here would be copied, half-initialised, into every forked rank.
"""

import warnings

# The fork server writes to the controller's terminal: megatron-core's import-time notices
# about optional packages must not land there.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", category=FutureWarning)

import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401

from shardcheck.harness.rank.plumbing.megatron_core import load_parallel_state  # noqa: E402

try:
    load_parallel_state()  # not the rest of megatron-core: a target that needs it imports it
except ImportError:  # the rank says so when it needs it
    pass

import shardcheck.harness.rank.main  # noqa: E402,F401

# The server lives until the controller's end closes its pipe; then a normal interpreter exit
# would spend a second or more tearing down torch's modules, outliving the command that started
# it. It has nothing to flush or free: leave at once (atexit runs the newest registration first).
import atexit  # noqa: E402
import os  # noqa: E402

atexit.register(os._exit, 0)
