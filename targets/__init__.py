"""Targets: the implementations under test, found by name.

A target spec is ``NAME`` or ``NAME:VARIANT`` for a target registered in the
``shardcheck.targets`` entry-point group (shardcheck's own register there too), or
``package.module:callable`` for any importable factory (called with no arguments) or instance.

Configuration (one hook for every target, built in or plugin): ``--target-src DIR`` and
``--target-opt KEY=VALUE`` become a :class:`TargetConfig`. A factory that takes a ``config``
parameter is called with it (``factory(variant, config=...)`` for a registered one, or
``factory(config=...)``); a factory that declares ``options = {KEY: help}`` has any other key
refused. Giving either to a factory without a ``config`` parameter is refused too: nothing
the user asked for is dropped silently. A registered factory's ``variants = {NAME: help}`` lists
the ``NAME:VARIANT`` specs it builds (``shardcheck targets`` shows both).
"""

from __future__ import annotations

import importlib
import inspect
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from shardcheck.errors import BadInput

if TYPE_CHECKING:  # base imports torch: at run time only where it is needed (see __getattr__)
    from shardcheck.targets.base import Target, TargetConfig

GROUP = "shardcheck.targets"

__all__ = ["CONTRACT_VERSION", "Capabilities", "PolicyBatch", "RankInputs", "RankOutputs", "Target", "TargetBase",
           "TargetConfig", "available", "loss_form", "resolve"]
_FROM_BASE = ("CONTRACT_VERSION", "Capabilities", "PolicyBatch", "RankInputs", "RankOutputs", "Target", "TargetBase",
              "TargetConfig", "loss_form")


def __getattr__(name: str) -> Any:
    # base imports torch: a command line that only needs a target's source flag (targets.source)
    # must not pay for it
    if name in _FROM_BASE:
        from shardcheck.targets import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _registered() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def available() -> list[dict[str, Any]]:
    """Registered targets (name, description, variants) for ``shardcheck targets``."""
    out = []
    for name, ep in sorted(_registered().items()):
        try:
            factory = ep.load()
            doc = (factory.__doc__ or "").strip().splitlines()
            variants = sorted(getattr(factory, "variants", {}) or {})
            out.append({"name": name, "description": doc[0] if doc else "", "variants": variants,
                        "variant_docs": dict(getattr(factory, "variants", {}) or {}),
                        "options": dict(getattr(factory, "options", {}) or {})})
        except Exception as exc:  # a broken plugin must not hide the others
            out.append({"name": name, "description": f"(cannot load: {exc})", "variants": []})
    return out


def resolve(spec: str, config: TargetConfig | None = None) -> Target:
    """The target a spec names, configured by ``config`` (default: the one in the environment);
    BadInput (one line) when it cannot be found, configured or built."""
    from shardcheck.targets.base import TargetConfig

    if config is None:
        try:
            config = TargetConfig.from_environment()
        except ValueError as exc:
            raise BadInput(str(exc)) from None
    if not spec or not isinstance(spec, str):
        raise BadInput("a target spec must be a non-empty string")
    head, _, tail = spec.partition(":")
    registered = _registered()
    if head in registered:
        try:
            factory = registered[head].load()
        except Exception as exc:
            raise BadInput(f"target {head!r} cannot be loaded: {type(exc).__name__}: {exc}") from None
        variants = getattr(factory, "variants", None)
        if tail and variants is not None and tail not in variants:
            raise BadInput(f"target {head!r} has no variant {tail!r} (known: {', '.join(sorted(variants))})")
        return _build(spec, factory, tail or None, config)
    if not tail:
        known = ", ".join(sorted(registered)) or "none"
        raise BadInput(f"unknown target {spec!r} (registered: {known}; or give module:callable)")
    try:
        module = importlib.import_module(head)
    except Exception as exc:
        raise BadInput(f"target {spec!r}: cannot import {head!r}: {type(exc).__name__}: {exc}") from None
    obj: Any = module
    for part in tail.split("."):
        if not hasattr(obj, part):
            raise BadInput(f"target {spec!r}: {head!r} has no attribute {tail!r}")
        obj = getattr(obj, part)
    return _build(spec, obj, None, config)


def _takes_config(obj: Any) -> bool:
    try:
        return "config" in inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return False


def _check_config(spec: str, obj: Any, config: TargetConfig) -> bool:
    """Whether to hand ``config`` to the factory; BadInput when the user gave what it cannot take."""
    given = [name for name, there in (("--target-src", config.src), ("--target-opt", config.options)) if there]
    if not _takes_config(obj) or _is_target(obj):
        if given:
            raise BadInput(f"target {spec!r} takes no {' or '.join(given)}")
        return False
    known = getattr(obj, "options", None)
    if known is not None:
        unknown = [k for k, _ in config.options if k not in known]
        if unknown:
            raise BadInput(f"target {spec!r} has no option {unknown[0]!r} "
                           f"(known: {', '.join(sorted(known)) or 'none'})")
    return True


def _build(spec: str, obj: Any, variant: str | None, config: TargetConfig) -> Target:
    target = obj
    with_config = _check_config(spec, obj, config)
    if not _is_target(obj):
        if not callable(obj):
            raise BadInput(f"target {spec!r} is neither a target nor a factory")
        args = (variant,) if variant is not None else ()
        try:
            target = obj(*args, config=config) if with_config else obj(*args)
        except BadInput:
            raise
        except Exception as exc:
            raise BadInput(f"target {spec!r} could not be built: {type(exc).__name__}: {exc}") from None
    if not _is_target(target):
        raise BadInput(f"target {spec!r} does not provide name, capabilities, describe() and compute()")
    from shardcheck.targets.contract import adopt

    return adopt(target, spec)


def _is_target(obj: Any) -> bool:
    from shardcheck.targets.contract import is_target

    return is_target(obj)


def release(target: Target) -> None:
    """Undo what ``target`` set in the process (kept for callers of earlier versions: ``target.release()``)."""
    target.release()
