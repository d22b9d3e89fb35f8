"""The framework targets as registered (the ``shardcheck.targets`` entry points verl, areal and
skyrl): each framework's adapter with its training-step loss variant.

A loss module builds on its framework's adapter (``verl_loss`` on ``verl``), so the factory that
offers both lives above the two rather than in the adapter: no circle of imports. Each adapter's
own ``target`` builds every variant but ``loss``.
"""

from __future__ import annotations

from typing import Any, Callable

from shardcheck.targets import areal, areal_loss, skyrl, skyrl_loss, verl, verl_loss
from shardcheck.targets.checkout import CheckoutFactory


def with_loss(base: CheckoutFactory, build_loss: Callable[[Any], Any]) -> CheckoutFactory:
    """``base``'s factory, its ``loss`` variant built by ``build_loss(config)``."""
    def build(variant: str | None, config: Any) -> Any:
        return build_loss(config) if variant == "loss" else base(variant, config)

    return CheckoutFactory(base.framework, build, doc=base.__doc__ or "", options=base.options,
                           variants=base.variants)


def _skyrl_loss(config: Any) -> Any:
    skyrl._refuse_old_tree(config.src)
    return skyrl_loss.SkyRLLossTarget(config)


verl_target = with_loss(verl.target, verl_loss.build)
areal_target = with_loss(areal.target, areal_loss.ArealLossTarget)
skyrl_target = with_loss(skyrl.target, _skyrl_loss)
