"""alibaba/ROLL's FSDP2 strategy with Ulysses sequence parallelism (``--target roll:fsdp``, targets/roll_fsdp.py).

Without a checkout the variant is refused in one line, as is a checkout whose ROLL has no FSDP2
strategy; the checkout test skips without SHARDCHECK_ROLL_SRC. With one at the pin (8eb27cc2dc34)
the sequence_parallel suite's Ulysses scenarios at tp 1 pass on ROLL's own rows (the padded batch
sliced along the sequence by get_feature_on_cp_rank: every sample on every rank), in float32 and
bfloat16; TP and ring attention are skipped with their reasons."""

from __future__ import annotations

import dataclasses
import os

import pytest

from conftest import run_on_world
from shardcheck.errors import BadInput
from shardcheck.scenarios import get_suite
from shardcheck.targets import roll, roll_fsdp
from shardcheck.targets.base import TargetConfig
from shardcheck.targets.frameworks import roll_target

ROLL_SRC = os.environ.get(roll.ENV)
needs_roll = pytest.mark.skipif(
    not ROLL_SRC, reason=f"{roll.ENV} is not set: no ROLL checkout to check (clone alibaba/ROLL at the pin "
    "8eb27cc2dc34 and point it there)")


def test_a_roll_checkout_without_the_fsdp2_strategy_is_refused_in_one_line(tmp_path):
    marker = tmp_path / roll.STRATEGY_FILE  # a ROLL checkout by its marker (the Megatron strategy), no FSDP2 one
    marker.parent.mkdir(parents=True)
    marker.write_text("")
    with pytest.raises(BadInput) as exc:
        roll_target("fsdp", TargetConfig(str(tmp_path)))
    assert roll_fsdp.NO_STRATEGY_WHY in str(exc.value) and "\n" not in str(exc.value)


def test_the_megatron_option_is_refused_for_the_fsdp_variant(tmp_path):
    with pytest.raises(BadInput) as exc:
        roll_target("fsdp", TargetConfig(str(tmp_path), (("logits_in_fp32", "true"),)))
    assert "logits_in_fp32" in str(exc.value) and "\n" not in str(exc.value)


def test_the_padded_length_is_the_smallest_the_ulysses_slice_accepts():
    assert [roll_fsdp.sequence_length([13, 8], cp) for cp in (1, 2, 4)] == [13, 14, 16]


@needs_roll
@pytest.mark.world
def test_the_sequence_parallel_suite_passes_on_rolls_own_rows(world, tmp_path):
    from shardcheck.run_config import RunConfig

    config = RunConfig("roll:fsdp", sources=(("roll", ROLL_SRC),))
    suite = get_suite("sequence_parallel")
    grid = suite + [dataclasses.replace(s, name=f"{s.name}-bf16", dtype="bfloat16") for s in suite
                    if s.layout == "ulysses" and s.tp == 1]
    run = run_on_world(world, grid, "roll:fsdp", tmp_path / "sp.json", "sequence_parallel", config=config)
    verdicts = {v["name"]: v for v in run.report["scenarios"]}
    passed = sorted(n for n, v in verdicts.items() if v["verdict"] == "pass")
    assert passed == sorted(["ulysses-sp2-padded", "ulysses-sp4-padding-rank", "ulysses-sp2-exact",
                             "ulysses-sp2-padded-bf16", "ulysses-sp4-padding-rank-bf16", "ulysses-sp2-exact-bf16"]), \
        {n: (v["verdict"], v.get("kinds"), v.get("reason")) for n, v in verdicts.items()}
    assert roll_fsdp.TP_WHY[:40] in verdicts["ulysses-tp2-sp2-chunks"]["reason"]
    assert "ring attention" in verdicts["ring-sp2-temperature"]["reason"]
    # ROLL's rows: both samples (13 and 8 tokens) padded to 14 and cut in two, on each SP rank
    layouts = verdicts["ulysses-sp2-padded"]["layouts"]
    assert {lay["built_by"] for lay in layouts.values()} == {roll_fsdp.RollFSDPDataPath.name}
    first = next(lay for lay in layouts.values() if lay["cp_rank"] == 0)
    assert first["shape"][:2] == [2, 7] and first["pieces"] == [[0, 0, 7], [1, 0, 7]], first
    assert run.report["target"]["code"].startswith(str(roll_fsdp.STRATEGY_FILE))
