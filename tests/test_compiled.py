"""compile_alone: a framework's definitions compiled alone from their file run its own lines and
name what they read that is not given, before anything runs."""

import textwrap
import traceback

import pytest

from shardcheck.targets.compiled import compile_alone

SOURCE = """
    import heavy_stack  # never imported: only the definitions below are compiled

    from heavy_stack import Config


    def scale(x: Config, factor: int = 2) -> Config:
        return helper(x) * factor


    def broken(x):
        raise ValueError("from the framework's line")


    class Holder:
        kind = "holder"

        def twice(self, x):
            return scale(x)
    """


def test_definitions_run_from_their_file_with_their_lines(tmp_path):
    path = tmp_path / "framework.py"
    path.write_text(textwrap.dedent(SOURCE))
    ns = compile_alone(path, ["scale", "broken", "Holder"], {"helper": lambda x: x + 1})
    assert ns["scale"](3) == 8 and ns["Holder"]().twice(1) == 4  # annotations (Config) never evaluated
    with pytest.raises(ValueError) as exc:
        ns["broken"](0)
    frame = traceback.extract_tb(exc.value.__traceback__)[-1]
    assert frame.filename == str(path) and frame.lineno == 12 and frame.name == "broken"


def test_a_name_not_given_or_a_definition_not_there_is_named(tmp_path):
    path = tmp_path / "framework.py"
    path.write_text(textwrap.dedent(SOURCE))
    with pytest.raises(LookupError, match="scale read helper, which the adapter does not give"):
        compile_alone(path, ["scale"], {})
    with pytest.raises(LookupError, match="no top-level missing_one"):
        compile_alone(path, ["scale", "missing_one"], {"helper": abs})


def test_on_a_rank_a_name_not_given_is_the_harness_s_not_the_target_s(tmp_path):
    """An era the adapter does not model (SkyRL's preprocess.py reading make_replay_padding_indices
    at 68326807a): the commit cannot run; a sweep showed it as the target's rank_error."""
    from shardcheck.errors import ShardcheckError
    from shardcheck.harness.rank.main import RankRunner
    from shardcheck.harness.wire import HARNESS_ERROR

    path = tmp_path / "framework.py"
    path.write_text(textwrap.dedent(SOURCE))
    with pytest.raises(ShardcheckError) as exc:
        compile_alone(path, ["scale"], {})
    kind, message, _ = RankRunner._raised(exc.value)
    assert kind == HARNESS_ERROR and message.startswith("the target could not be run here: ")
