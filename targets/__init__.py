"""Targets: the implementations under test, found by name.

A target spec is ``NAME`` or ``NAME:VARIANT`` for a target registered in the
``shardcheck.targets`` entry-point group (shardcheck's own register there too), or
``package.module:callable`` for any importable factory (called with no arguments) or instance.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from shardcheck.errors import BadInput
from shardcheck.targets.base import Capabilities, PolicyBatch, RankInputs, RankOutputs, Target, loss_form

GROUP = "shardcheck.targets"

__all__ = ["Capabilities", "PolicyBatch", "RankInputs", "RankOutputs", "Target", "available", "loss_form",
           "resolve"]


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
                        "variant_docs": dict(getattr(factory, "variants", {}) or {})})
        except Exception as exc:  # a broken plugin must not hide the others
            out.append({"name": name, "description": f"(cannot load: {exc})", "variants": []})
    return out


def resolve(spec: str) -> Target:
    """The target a spec names; BadInput (one line) when it cannot be found or built."""
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
        return _build(spec, factory, tail or None)
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
    return _build(spec, obj, None)


def _build(spec: str, obj: Any, variant: str | None) -> Target:
    target = obj
    if not _is_target(obj):
        if not callable(obj):
            raise BadInput(f"target {spec!r} is neither a target nor a factory")
        try:
            target = obj(variant) if variant is not None else obj()
        except Exception as exc:
            raise BadInput(f"target {spec!r} could not be built: {type(exc).__name__}: {exc}") from None
    if not _is_target(target):
        raise BadInput(f"target {spec!r} does not provide name, capabilities, describe() and compute()")
    return target


def _is_target(obj: Any) -> bool:
    return not isinstance(obj, type) and isinstance(obj, Target)
