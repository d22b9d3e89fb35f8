import json

import pytest

from shardcheck.errors import BadInput
from shardcheck.scenarios import Sample, Scenario, get_suite, load_scenario_file


def _sc(**kw):
    base = dict(name="s", samples=[[10, 4]], vocab=8)
    return Scenario(**(base | kw))


def test_round_trip_through_json_is_exact():
    for sc in get_suite("smoke"):
        back = Scenario.from_json(sc.to_json())
        assert back == sc and back.to_dict() == sc.to_dict()
        assert json.loads(sc.to_json())["samples"][0] == [sc.samples[0].total, sc.samples[0].response]


def test_key_is_content_not_name():
    a, b = _sc(name="a"), _sc(name="b")
    assert a.key == b.key
    assert _sc(seed=1).key != a.key


@pytest.mark.parametrize(
    "kw,fragment",
    [
        (dict(samples=[[5, 5]]), "response length 5 > total length 5 - 1"),
        (dict(samples=[[5, 0]]), "response length 0 must be at least 1"),
        (dict(samples=[[-5, 2]]), "sample 0: total length -5 must be at least 2 (a prompt token and a response token)"),
        (dict(samples=[[1, 1]]), "total length 1 must be at least 2"),
        (dict(samples=[]), "at least one sample"),
        (dict(samples=[[5]]), "must be [total, response]"),
        (dict(samples=[[5.5, 2]]), "must be integers"),
        (dict(vocab=10, tp=4), "vocab 10 is not divisible by tp 4"),
        (dict(layout="zigzag"), "needs cp >= 2"),
        (dict(layout="thd", cp=2), "cp must be 1"),
        (dict(layout="tree"), "layout 'tree' is not one of"),
        (dict(layout="ulysses"), "layout ulysses needs sp >= 2, got sp=1"),
        (dict(layout="thd", sp=2), "layout thd has no sequence parallelism: sp must be 1, got 2"),
        (dict(layout="ring", cp=2, sp=2), "layout ring is sequence parallel over sp: cp must be 1, got 2"),
        (dict(layout="ulysses", sp=0), "tp, cp and sp must be >= 1"),
        (dict(log_probs_chunk_size=0), "log_probs_chunk_size"),
        (dict(temperature=0.0), "temperature must be finite and > 0"),
        (dict(dtype="int8"), "dtype 'int8'"),
        (dict(with_entropy=False, entropy_coef=0.1), "needs with_entropy"),
        (dict(entropy_coef=float("nan")), "entropy_coef must be finite"),
        (dict(vocab=0), "vocab 0 < 1"),
        (dict(tp=True), "tp must be an integer"),
    ],
)
def test_validation_names_the_problem(kw, fragment):
    with pytest.raises(BadInput) as exc:
        _sc(**kw)
    assert fragment in str(exc.value)
    assert "'s'" in str(exc.value) or "scenario name" in str(exc.value)


def test_from_dict_rejects_unknown_and_missing_fields():
    with pytest.raises(BadInput, match="unknown field"):
        Scenario.from_dict({"name": "x", "samples": [[3, 1]], "vocab": 4, "tpp": 2})
    with pytest.raises(BadInput, match="missing field"):
        Scenario.from_dict({"name": "x", "samples": [[3, 1]]})
    with pytest.raises(BadInput, match="JSON object"):
        Scenario.from_dict([1, 2])


def test_scenario_file_errors(tmp_path):
    with pytest.raises(BadInput, match="does not exist"):
        load_scenario_file(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(BadInput, match="not valid JSON"):
        load_scenario_file(bad)
    many = tmp_path / "two.json"
    many.write_text(json.dumps([_sc(name="a").to_dict(), {"name": "b", "samples": [[3, 3]], "vocab": 8}]))
    with pytest.raises(BadInput, match=r"entry 1: scenario 'b'"):
        load_scenario_file(many)


def test_unknown_suite():
    with pytest.raises(BadInput, match="unknown suite 'nope'"):
        get_suite("nope")


def test_sample_prompt():
    assert Sample(10, 4).prompt == 6


def test_a_scenario_file_with_two_scenarios_of_one_name_is_refused_naming_both(tmp_path):
    """--scenario, the reports and a replay name a scenario by its name: two of one name would
    have one of them run silently, and reports could not tell them apart."""
    import json

    from shardcheck.scenarios.suites import load_scenario_file

    f = tmp_path / "s.json"
    f.write_text(json.dumps([{"name": "a", "samples": [[5, 2]], "vocab": 8},
                             {"name": "b", "samples": [[5, 2]], "vocab": 8},
                             {"name": "a", "samples": [[6, 2]], "vocab": 8}]))
    with pytest.raises(BadInput, match=r"entries 0 and 2 are both named 'a'"):
        load_scenario_file(f)
