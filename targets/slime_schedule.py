"""slime's own split of a training step's global batch: ``build_dp_schedule`` (slime/utils/dp_schedule.py,
since #1926 on the rollout side), compiled alone from its file with the packing functions it calls
(slime/utils/seqlen_balancing.py), so the controller can ask it too without importing slime.

The scenario's sizes are handed over as slime's arguments: a token budget ``micro_batch_tokens``
is slime's ``--use-dynamic-batch-size`` with ``--max-tokens-per-gpu`` = budget / cp (slime's bin holds
``max_tokens_per_gpu * cp_size`` tokens); a fixed ``micro_batch_size`` is its static path. Every sample
is a rollout of its own, and the scenario is one step (``global_batch_size`` = its samples).
"""

from __future__ import annotations

import ast
import copy
import heapq
import inspect
import logging
from argparse import Namespace
from pathlib import Path
from typing import Any

from shardcheck.targets.compiled import compile_alone

SCHEDULE_FILE = Path("slime/utils/dp_schedule.py")
BALANCING_FILE = Path("slime/utils/seqlen_balancing.py")
SOURCE = f"build_dp_schedule ({SCHEDULE_FILE})"


def build_dp_schedule(src: Path) -> Any:
    """slime's ``build_dp_schedule`` at checkout ``src``, or None where the commit has none."""
    if not (src / SCHEDULE_FILE).is_file() or not (src / BALANCING_FILE).is_file():
        return None
    balancing = compile_alone(src / BALANCING_FILE, ["karmarkar_karp", "greedy_partition",
                                                     "get_seqlen_balanced_partitions", "first_fit_pack",
                                                     "_split_bin_by_tokens", "expand_bins_by_splitting"],
                              {"copy": copy, "heapq": heapq})
    given = {name: balancing[name] for name in ("first_fit_pack", "expand_bins_by_splitting",
                                                "get_seqlen_balanced_partitions")}
    # its helpers as the commit has them (#1926 packed inline; #2017 moved the packing into
    # _pack_step_into_mbs with a FLOPs workload beside it)
    defined = {n.name for n in ast.parse((src / SCHEDULE_FILE).read_text()).body if isinstance(n, ast.FunctionDef)}
    helpers = [n for n in ("_pack_step_into_mbs", "_calculate_workloads") if n in defined]
    schedule = compile_alone(src / SCHEDULE_FILE, ["build_dp_schedule", *helpers],
                             {"logger": logging.getLogger("slime.utils.dp_schedule"), **given},
                             off_path=["calculate_fwd_flops"])  # FLOPs balancing only: off by default
    return schedule["build_dp_schedule"]


def split(build: Any, totals: list[int], dp: int, cp: int, micro_batch_size: int,
          micro_batch_tokens: int) -> list[list[tuple[int, ...]]]:
    """Per replica, the sample indices of its micro-batches as slime's ``build_dp_schedule`` splits
    the step; ValueError with slime's own words where it refuses the sizes."""
    if micro_batch_tokens and micro_batch_tokens % cp:
        raise ValueError(f"slime's token budget is --max-tokens-per-gpu x cp: micro_batch_tokens {micro_batch_tokens} "
                         f"is not a multiple of cp {cp}")
    args = Namespace(use_dynamic_batch_size=bool(micro_batch_tokens),
                     max_tokens_per_gpu=micro_batch_tokens // cp if micro_batch_tokens else None,
                     micro_batch_size=micro_batch_size or len(totals) // dp, balance_data=False, balance_by_flops=False)
    config = {"dp_size": dp, "cp_size": cp, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
    # rollout_indices came with #2017 (and a fourth result); #1926's build_dp_schedule took neither;
    # #1984 named them group_indices until its revert: every sample a rollout, a group, of its own
    params = inspect.signature(build).parameters
    more = {name: list(range(len(totals))) for name in ("rollout_indices", "group_indices") if name in params}
    try:
        partitions, micro_batch_indices, *_ = build(args, config, list(totals), global_batch_size=len(totals), **more)
    except AssertionError as exc:  # slime's own checks of its configuration
        raise ValueError(f"slime's build_dp_schedule refuses it: {' '.join(str(exc).split())}") from None
    return [[tuple(partitions[r][j] for j in mb) for mb in micro_batch_indices[r]] for r in range(dp)]
