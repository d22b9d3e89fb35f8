"""The rank side's one owner of process-group state (its module globals below; :func:`reset`).

megatron-core's ``parallel_state`` holds the groups (as in the frameworks under test); this
module is the only one that initialises, rebuilds or queries it. Everyone else asks here.
"""

from __future__ import annotations

from typing import Any

_config: tuple[int, int] | None = None
_timeout_s: float = 60.0
# megatron's group globals per (tp, cp) already built in this world: switching back restores them
# instead of creating the groups again (gloo groups are never freed; a long run would pile them up)
_built: dict[tuple[int, int], dict[str, Any]] = {}


def reset() -> None:
    """Forget every layout built here (their groups die with the default group), so a world
    joined later in this process starts clean."""
    global _config
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    _built.clear()
    _config = None


def set_timeout(seconds: float) -> None:
    """Collective timeout for groups built from now on (a hung group raises after this)."""
    global _timeout_s
    _timeout_s = seconds


def configure(tp: int, cp: int) -> None:
    """Make (tp, cp) the current model-parallel layout, rebuilding groups only on change.

    Every rank must call this with the same arguments in the same order (group creation is
    collective). Ranks are ordered TP-fastest, then CP, then data parallel, as megatron does.
    """
    global _config
    if _config == (tp, cp):
        return
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    _config = None
    if (tp, cp) in _built:
        for name, value in _built[(tp, cp)].items():
            setattr(ps, name, value)
    else:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            context_parallel_size=cp,
            distributed_timeout_minutes=_timeout_s / 60.0,
            create_gloo_process_groups=False,
        )
        _built[(tp, cp)] = {k: v for k, v in vars(ps).items() if k.startswith("_") and k[1:2].isupper()}
    _config = (tp, cp)


def _ps() -> Any:
    if _config is None:
        raise RuntimeError("process groups are not configured: call groups.configure(tp, cp) first")
    from megatron.core import parallel_state as ps

    return ps


def tp_group() -> Any:
    return _ps().get_tensor_model_parallel_group()


def cp_group() -> Any:
    return _ps().get_context_parallel_group()


def tp_rank() -> int:
    return _ps().get_tensor_model_parallel_rank()


def cp_rank() -> int:
    return _ps().get_context_parallel_rank()


def dp_rank() -> int:
    return _ps().get_data_parallel_rank()


def label(group_name: str) -> str:
    """What a group is for ("tp", "cp", "dp", ...), from its name; "" when unknown."""
    if _config is None:
        return ""
    ps = _ps()
    getters = [("tp", ps.get_tensor_model_parallel_group), ("cp", ps.get_context_parallel_group),
               ("dp", ps.get_data_parallel_group)]
    for name, get in getters:
        try:
            if get().group_name == group_name:
                return name
        except (AssertionError, RuntimeError, AttributeError):
            continue
    return ""
