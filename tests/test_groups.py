"""harness/rank/plumbing/groups.py: megatron-core's layouts built once per world and switched back from
its cache exactly as megatron built them, and reset() putting every module global back.

Each check runs in a child process on torch's fake process group (a world of 8 in one process,
no peers): the default group and megatron's parallel_state are process-wide, and this pytest
process must not be left holding them.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_CHECKS = r"""
import __future__, copy, inspect, json, sys
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardcheck.harness.rank.plumbing import groups

def state(module):
    return {k: v for k, v in vars(module).items()
            if not (k.startswith("__") or inspect.ismodule(v) or inspect.isroutine(v) or inspect.isclass(v)
                    or isinstance(v, __future__._Feature))}

# taken before anything here runs: what reset() must put back, written down independently of it
AT_IMPORT = copy.deepcopy(state(groups))

from megatron.core import parallel_state as ps

def value(v):
    if v is c10d.GroupMember.NON_GROUP_MEMBER:
        return "NON_GROUP_MEMBER"
    if isinstance(v, dist.ProcessGroup):
        return ["group", getattr(v, "group_desc", ""), dist.get_process_group_ranks(v)]
    if isinstance(v, (list, tuple)):
        return [value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): value(x) for k, x in v.items()}
    return v if v is None or isinstance(v, (int, float, str, bool)) else type(v).__name__

def seen():
    # every data global of parallel_state, groups by description and ranks (their names depend
    # on how many groups the process made before)
    return {k: value(v) for k, v in state(ps).items() if k not in ("logger",)}

out = {}
PS_BEFORE = seen()
dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
groups.set_timeout(30.0)
groups.configure(2, 2)
first = seen()
groups.configure(4, 1)
second = seen()
made = c10d._world.group_count
groups.configure(2, 2)
out["switched back"] = seen() == first
groups.configure(4, 1)
out["switched back again"] = seen() == second
out["groups made by switching back"] = c10d._world.group_count - made
out["tp ranks"] = dist.get_process_group_ranks(groups.tp_group())
groups.share_rank_lists(True)
groups.configure(1, 8)
groups.reset()
out["parallel_state after reset"] = [k for k, v in seen().items() if v != PS_BEFORE.get(k)]
after = state(groups)
out["globals after reset"] = sorted(k for k in set(AT_IMPORT) | set(after)
                                    if k not in AT_IMPORT or k not in after or after[k] != AT_IMPORT[k])
out["configured after reset"] = groups.member_groups()
dist.destroy_process_group()

# the layout built second, switched away from and back, against megatron from scratch
dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
ps.initialize_model_parallel(tensor_model_parallel_size=4, context_parallel_size=1,
                             distributed_timeout_minutes=0.5, create_gloo_process_groups=False)
out["differs from scratch"] = sorted(k for k, v in seen().items() if v != second.get(k))
ps.destroy_model_parallel()
dist.destroy_process_group()
print(json.dumps(out))
"""


def _checked(folder) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CHECKS], capture_output=True, text=True, timeout=300, cwd=folder)


# the child's seconds (importing torch and megatron-core) spent beside the suite (tests/background.py)
BACKGROUND = {"groups-child": (_checked, 300)}


@pytest.fixture
def checked(background) -> dict:
    proc = background("groups-child")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.background("groups-child")
def test_a_layout_switched_back_to_is_megatrons_own_and_makes_no_groups(checked):
    assert checked["switched back"] and checked["switched back again"]
    assert checked["groups made by switching back"] == 0
    assert checked["tp ranks"] == [4, 5, 6, 7]
    assert checked["differs from scratch"] == []


@pytest.mark.background("groups-child")
def test_reset_puts_every_module_global_and_parallel_state_back(checked):
    assert checked["globals after reset"] == []
    assert checked["parallel_state after reset"] == []
    assert checked["configured after reset"] == []
