"""The framework targets as registered (the ``shardcheck.targets`` entry points verl, areal, skyrl,
miles and roll): each framework's adapter with its training-step loss variant (and verl's, AReaL's and
ROLL's FSDP engines).

A loss module builds on its framework's adapter (``verl_loss`` on ``verl``), so the factory that
offers both lives above the two rather than in the adapter: no circle of imports. Each adapter's
own ``target`` builds every variant but ``loss`` (verl's and AReaL's: but ``loss`` and ``fsdp``).
"""

from __future__ import annotations

from typing import Any, Callable

from shardcheck.errors import BadInput
from shardcheck.targets import (areal, areal_fsdp, areal_loss, miles, miles_loss, roll, roll_fsdp, skyrl, skyrl_loss,
                                verl, verl_fsdp, verl_loss)
from shardcheck.targets.checkout import CheckoutFactory


def with_loss(base: CheckoutFactory, build_loss: Callable[[Any], Any],
              others: dict[str, Callable[[str, Any], Any]] | None = None) -> CheckoutFactory:
    """``base``'s factory, its ``loss`` variant built by ``build_loss(config)`` and each variant
    of ``others`` by its builder ``(variant, config)``."""
    others = others or {}

    def build(variant: str | None, config: Any) -> Any:
        if variant in others:
            return others[variant](variant, config)
        if variant == "loss":
            given = [k for k, _ in config.options if k not in LOSS_OPTIONS.get(base.framework.name, (k,))]
            if given:
                raise BadInput(f"target '{base.framework.name}:loss': option {given[0]} is not its own")
            return build_loss(config)
        return base(variant, config)

    return CheckoutFactory(base.framework, build, doc=base.__doc__ or "", options=base.options,
                           variants=base.variants)


def _skyrl_loss(config: Any) -> Any:
    skyrl._refuse_old_tree(config.src)
    return skyrl_loss.SkyRLLossTarget(config)


# the options a loss variant takes (a framework not named here: any, as before)
LOSS_OPTIONS = {"verl": verl.LOSS_OPTIONS, "miles": ("layout", "calculate_per_token_loss")}

verl_target = with_loss(verl.target, verl_loss.build, {"fsdp": verl_fsdp.build})
areal_target = with_loss(areal.target, areal_loss.ArealLossTarget, {"fsdp": areal_fsdp.build})
skyrl_target = with_loss(skyrl.target, _skyrl_loss)
miles_target = with_loss(miles.target, miles_loss.build)


def _roll(variant: str | None, config: Any) -> Any:
    if variant == "fsdp":
        if config.get("logits_in_fp32") is not None:
            raise BadInput("target 'roll': option logits_in_fp32 applies to the Megatron strategy (roll) only")
        return roll_fsdp.RollFSDPTarget(config.src)
    return roll.target(None, config)


roll_target = CheckoutFactory(
    roll.FRAMEWORK, _roll, doc=roll.target.__doc__ or "", options=roll.target.options,
    variants={"fsdp": "ROLL's FSDP2 strategy with Ulysses sequence parallelism: FSDP2InferStrategy.op_compute_log_probs "
                      "/ op_compute_entropy (compiled alone) with ulysses_gather, on ROLL's rows (the padded batch sliced "
                      "by get_feature_on_cp_rank); --suite sequence_parallel"})
