"""The rank side's one owner of process-group state (its module globals below; :func:`reset`
puts every one of them back as it was at import).

megatron-core's ``parallel_state`` holds the groups (as in the frameworks under test); this
module is the only one that initialises, switches or queries it. Everyone else asks here.

A world runs scenarios of several (tp, cp) layouts in turn. The first time a layout is asked
for, megatron-core's own ``destroy_model_parallel()`` and ``initialize_model_parallel(...)``
build it, and what that call set in ``parallel_state`` (every module global it changed: the
groups, their rank lists, megatron's list of groups, its memory buffer) is kept in
:data:`_built`, keyed by (tp, cp). Switching back to a layout built before runs
``destroy_model_parallel()`` and puts those values back instead of creating the groups again:
creating a group is a rendezvous of the whole world, and megatron never frees a group
(``destroy_model_parallel`` only drops its references), so rebuilding on every switch would be
slow and would pile groups up in torch. Every rank calls :func:`configure` with the same
arguments in the same order, so every rank builds (collectively) and restores (locally) the
same layouts at the same points.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 60.0

# the (tp, cp) parallel_state holds now; None: none built here, or the world was left
_config: tuple[int, int, int] | None = None
_timeout_s: float = DEFAULT_TIMEOUT_S
# parallel_state's data globals as this module found them (after destroy_model_parallel), taken
# before the first layout it builds in a world: what every layout's values are told apart from,
# and what leaving the world puts back
_clean: dict[str, Any] | None = None
# per (tp, cp) built in this world, the parallel_state globals its initialize_model_parallel set
# (those not identical to _clean's): the layout cache configure switches with
_built: dict[tuple[int, int], dict[str, Any]] = {}
# The fake world's fast path (share_rank_lists): megatron's rank lists, computed once per
# (world size, sizes, mask) and kept across the simulated ranks of this process
_share = False
_rank_lists: dict[tuple[int, tuple[int, ...], tuple[bool, ...]], list[list[int]]] = {}
_RANK_LISTS_KEPT = 256  # kinds of lists kept at most (about 16 a layout; a search draws many layouts)
# per (layout, key), what a framework's own code built in this world (its DeviceMesh, its groups):
# built once, collectively, by framework_groups
_framework: dict[tuple[Any, Hashable], Any] = {}
# the name of each group a framework's own code built -> (the layout it was built for, what it is
# for: "sp", "tp", "dp", ...)
_framework_roles: dict[str, tuple[Any, str]] = {}
# the roles a framework's group may take, and the harness's group of that role it must equal
ROLES = ("tp", "sp", "cp", "dp", "dp_cp", "world")
# the phase the trace gives the harness's own calls around a framework's group creation
SET_UP = "framework groups set-up"


def reset() -> None:
    """Everything this module holds back to its state at import: the world left
    (:func:`leave_world`), the collective timeout, the fake world's rank-list sharing and the
    lists it kept. For a process done with its world (a joined world may be followed by another,
    which sets its own timeout)."""
    global _timeout_s, _share
    leave_world()
    _timeout_s = DEFAULT_TIMEOUT_S
    _share = False
    _rank_lists.clear()


def leave_world() -> None:
    """Forget every layout built here (their groups die with the default group) and put
    megatron's parallel_state back as this module found it, so a world joined later in this
    process starts clean; the settings (timeout, rank-list sharing and its lists) are kept, as
    the fake world needs between two simulated ranks, each a world of its own."""
    global _config, _clean
    if _clean is not None:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        _put(ps, {})
    _built.clear()
    _framework.clear()
    _framework_roles.clear()
    _config = None
    _clean = None


def set_timeout(seconds: float) -> None:
    """Collective timeout for groups built from now on (a hung group raises after this)."""
    global _timeout_s
    _timeout_s = seconds


def share_rank_lists(on: bool) -> None:
    """The fake world's fast path (on fake process groups only; a real world never calls this).

    megatron-core's ``initialize_model_parallel`` still runs for every simulated rank and decides
    everything that rank holds, with two differences: the rank lists it computes
    (``generate_masked_orthogonal_rank_groups``, the one source of every group's ranks) are
    computed once per layout and handed out again, as copies, to every later rank; and a group
    the rank is not a member of is not created (torch would return ``NON_GROUP_MEMBER`` for it
    anyway; its name is still taken, so every group the rank is in has the name it would have).
    A 512-rank world has 2,971 groups, of which a rank is in 17: creating all of them was 50 ms
    a simulated rank. ``tests/test_simulate.py`` checks the groups each rank gets against a
    from-scratch ``initialize_model_parallel``.
    """
    global _share
    _share = on


@contextlib.contextmanager
def _shared_rank_lists(ps: Any) -> Iterator[None]:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    generate, create = ps.generate_masked_orthogonal_rank_groups, ps.create_group
    rank = dist.get_rank()

    def rank_lists(world_size: int, parallel_size: list[int], mask: list[bool]) -> list[list[int]]:
        key = (world_size, tuple(parallel_size), tuple(mask))
        lists = _rank_lists.get(key)
        if lists is None:
            if len(_rank_lists) >= _RANK_LISTS_KEPT:
                _rank_lists.clear()
            lists = _rank_lists[key] = generate(world_size, parallel_size, mask)
        return [list(ranks) for ranks in lists]  # megatron may offset them in place

    def create_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        if ranks is None or rank in ranks:
            return create(ranks, *args, **kwargs)
        # what torch's new_group does for a non-member, less the group it never hands out: it
        # takes the group's name (torch's own naming step, so the rank's later groups are named
        # as they would be) and returns no group
        local = bool(kwargs.get("use_local_synchronization"))
        c10d._process_group_name(list(ranks), use_hashed_name=local)
        return None if local else c10d.GroupMember.NON_GROUP_MEMBER

    ps.generate_masked_orthogonal_rank_groups, ps.create_group = rank_lists, create_group
    try:
        yield
    finally:
        ps.generate_masked_orthogonal_rank_groups, ps.create_group = generate, create


def configure(tp: int, cp: int, sp: int = 1) -> None:
    """Make (tp, cp) the current model-parallel layout: built by megatron-core the first time it
    is asked for in this world, put back from :data:`_built` after that (the module docstring).

    Every rank must call this with the same arguments in the same order (group creation is
    collective). Ranks are ordered TP-fastest, then CP, then data parallel, as megatron does.

    ``sp`` (the DTensor family's sequence parallelism, with cp 1): the sequence axis is then the
    sp group, built as megatron builds a CP group of that size (the same ranks a Ulysses group
    holds: TP fastest, then the sequence); :func:`sp_group` names it, and the trace labels it sp.
    """
    global _config, _clean
    if _config == (tp, cp, sp):
        return
    if _config is not None and (_config[0], _config[1] * _config[2]) == (tp, cp * sp):
        _config = (tp, cp, sp)  # the same groups, the sequence axis named otherwise
        return
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    _config = None
    if _clean is None:
        _clean = _data_globals(ps)
    cp = cp * sp  # the sequence axis's groups, whichever family shards it
    layout = _built.get((tp, cp))
    if layout is None:
        # from the state megatron starts from in a fresh process, less what it holds of nothing
        # built here (destroy_model_parallel leaves some globals, the rank lists, as they were)
        _put(ps, {})
        with _shared_rank_lists(ps) if _share else contextlib.nullcontext():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                context_parallel_size=cp,
                distributed_timeout_minutes=_timeout_s / 60.0,
                create_gloo_process_groups=False,
            )
        now = _data_globals(ps)
        layout = _built[(tp, cp)] = {k: v for k, v in now.items() if k not in _clean or v is not _clean[k]}
    _put(ps, layout)
    _config = (tp, cp // sp, sp)


def _data_globals(ps: Any) -> dict[str, Any]:
    """parallel_state's module globals that hold state (not its functions, classes or imports)."""
    return {k: v for k, v in vars(ps).items()
            if not (k.startswith("__") or inspect.ismodule(v) or inspect.isroutine(v) or inspect.isclass(v))}


def _put(ps: Any, layout: dict[str, Any]) -> None:
    """parallel_state's globals as ``layout`` holds them: every global any layout built here set
    takes the layout's value, or the one this module found (``{}``: parallel_state as found)."""
    assert _clean is not None
    for name in set().union(*_built.values()):
        setattr(ps, name, layout[name] if name in layout else _clean.get(name))


def _ps() -> Any:
    if _config is None:
        raise RuntimeError("process groups are not configured: call groups.configure(tp, cp) first")
    from megatron.core import parallel_state as ps

    return ps


def tp_group() -> Any:
    return _ps().get_tensor_model_parallel_group()


def cp_group() -> Any:
    """Megatron's context-parallel group: the sequence axis's (under sp, the sp group's ranks)."""
    return _ps().get_context_parallel_group()


def sp_group() -> Any:
    """The sequence-parallel group of an sp layout (:func:`configure`); None without one."""
    return cp_group() if sp_size() > 1 else None


def sp_size() -> int:
    return _config[2] if _config is not None else 1


def dp_cp_group() -> Any:
    """The data-parallel group with CP: what DDP averages the gradient over."""
    return _ps().get_data_parallel_group(with_context_parallel=True)


def tp_rank() -> int:
    return _ps().get_tensor_model_parallel_rank()


def cp_rank() -> int:
    return _ps().get_context_parallel_rank()


def dp_rank() -> int:
    return _ps().get_data_parallel_rank()


def dp_size() -> int:
    return _ps().get_data_parallel_world_size()


def _harness_group(role: str) -> Any:
    import torch.distributed as dist

    ps = _ps()
    return {"tp": ps.get_tensor_model_parallel_group, "sp": ps.get_context_parallel_group,
            "cp": ps.get_context_parallel_group, "dp": ps.get_data_parallel_group,
            "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
            "world": lambda: dist.group.WORLD}[role]()


def framework_groups(key: Hashable, build: Callable[[], T], roles: Callable[[T], Mapping[str, Any]]) -> T:
    """What ``build()`` returns: a framework's own code building its process groups (its
    ``init_device_mesh``, its engine's set-up), run once per key and layout in this world and
    kept; ``roles(built)`` names each group it built that the framework will call collectives in
    (:data:`ROLES`).

    Every rank calls this with the same key in the same order (group creation is collective).
    Before the first build, a barrier of the world: torch waits for a group's missing member
    without bound (its 30-minute default), the barrier is a traced call the lockstep watches, so
    a rank that never gets here is reported, not waited for. After it, each named group must hold
    the ranks the harness's group of that role holds (the harness lays each rank's batch out by
    its own groups): the whole world's lists are compared on every rank, so every rank refuses
    alike (:class:`shardcheck.errors.BadInput`, the harness's error: such a world cannot check
    that framework's layout). The groups are then labelled by their role for the trace, and
    counted among this rank's groups (:func:`member_groups`).
    """
    full = (_config, key)
    if full in _framework:
        return _framework[full]
    _ps()  # configured first: the roles are checked against its groups
    import torch.distributed as dist

    from shardcheck.harness.rank.plumbing import trace

    with trace.labelled(SET_UP):
        dist.barrier()
    built = build()
    named = dict(roles(built))
    unknown = sorted(set(named) - set(ROLES))
    if unknown:
        raise ValueError(f"framework_groups: unknown roles {unknown} (roles: {', '.join(ROLES)})")
    mine = {role: (sorted(dist.get_process_group_ranks(group)), sorted(dist.get_process_group_ranks(
        _harness_group(role)))) for role, group in named.items()}
    if _share:  # the fake world moves no data: this rank's own lists are all it can compare
        everyone = [mine]
    else:
        everyone = [None] * dist.get_world_size()
        with trace.labelled(SET_UP):
            dist.all_gather_object(everyone, mine)
    for rank, lists in enumerate(everyone):
        for role, (theirs, ours) in sorted((lists or {}).items()):
            if theirs != ours:
                from shardcheck.errors import BadInput

                raise BadInput(f"{key}: the framework's own {role} group of global rank {rank} holds ranks {theirs}, "
                               f"the harness's {role} group holds {ours}: the harness lays each rank's batch out by "
                               f"its own groups, so this world cannot check this framework's layout")
    for role, group in named.items():
        _framework_roles[group.group_name] = (_config, role)
    _framework[full] = built
    return built


def member_groups() -> list[str]:
    """The names of the groups this rank belongs to (tp, cp, dp and the world), as the trace
    names a call's group; [] before the groups are configured."""
    if _config is None:
        return []
    import torch.distributed as dist

    ps = _ps()
    names = []
    for get in (ps.get_tensor_model_parallel_group, ps.get_context_parallel_group, ps.get_data_parallel_group,
                lambda: dist.group.WORLD):
        try:
            names.append(get().group_name)
        except (AssertionError, RuntimeError, AttributeError):
            continue
    return names + [name for name, (layout, _) in _framework_roles.items() if layout == _config and name not in names]


def label(group_name: str) -> str:
    """What a group is for ("tp", "cp", "dp", ...), from its name; "" when unknown."""
    if _config is None:
        return ""
    if group_name in _framework_roles:
        return _framework_roles[group_name][1]
    ps = _ps()
    getters = [("tp", ps.get_tensor_model_parallel_group), ("sp" if sp_size() > 1 else "cp", ps.get_context_parallel_group),
               ("dp", ps.get_data_parallel_group)]
    for name, get in getters:
        try:
            if get().group_name == group_name:
                return name
        except (AssertionError, RuntimeError, AttributeError):
            continue
    return ""
