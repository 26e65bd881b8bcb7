"""Adding a scoring option takes one declaration (issue 39): a ScoringSettings subclass with one
new declared field stands in for the edit, and the option then appears in ``score --help``,
in ``check``'s parsed settings, in ``/v1/score``'s ``icqs_options`` model, in the fingerprint
and the job's resume key, in what the ``--ray`` driver hands its actors, and in the docs'
option tables; an out-of-bounds value gets the same message, naming the flag, from the command
line and from the server."""

from __future__ import annotations

import argparse
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest

from icqs_fast.engine import settings
from icqs_fast.options import option

PKG = Path(__file__).resolve().parents[1] / "icqs_fast" / "data"
DEMOS = ["--good", str(PKG / "demo_good.jsonl"), "--bad", str(PKG / "demo_bad.jsonl")]
MESSAGE = "--novelty must be an int in [1, 9], got 0"


@dataclass(frozen=True)
class Extended(settings.ScoringSettings):
    """ScoringSettings with ONE more declared option (module level: the driver pickles it)."""

    novelty: int = option(3, ge=1, le=9, request=True, help="a new option, for this test")


@pytest.fixture()
def extended(monkeypatch):
    # Every place that derives from the declarations looks the class up when it runs.
    monkeypatch.setattr(settings, "ScoringSettings", Extended)
    return Extended


def _parser(command: str) -> argparse.ArgumentParser:
    import importlib

    p = argparse.ArgumentParser(prog=f"icqs-fast {command}")
    importlib.import_module(f"icqs_fast.cli.{command}").add_arguments(p)
    return p


def test_the_option_is_a_flag_of_score_and_check(extended):
    text = _parser("score").format_help()
    assert "--novelty N" in text and "a new option, for this test (default 3)" in text
    from icqs_fast.cli.options import score_config

    args = _parser("check").parse_args([*DEMOS, "--novelty", "5"])
    config = score_config(args, input="-", output=os.devnull)
    assert type(config.scoring) is Extended and config.scoring.novelty == 5
    from icqs_fast.cli.score import build_config

    args = _parser("score").parse_args(["in.jsonl", "-o", "o.jsonl", *DEMOS, "--novelty", "7"])
    assert build_config(args).scoring.novelty == 7


def test_the_option_is_in_the_fingerprint_and_the_resume_key(extended):
    from icqs_fast.jobs.config import ScoreJobConfig

    s = Extended(novelty=5)
    assert s.fingerprint()["novelty"] == 5 and s.replace(novelty=6).fingerprint() != \
        s.fingerprint()
    config = ScoreJobConfig(input="-", output=os.devnull, good=DEMOS[1], bad=DEMOS[3],
                            scoring=s)
    assert config.resume_key()["novelty"] == 5
    # An output written before the option existed resumes when it is at its default.
    old = ScoreJobConfig(input="-", output=os.devnull, good=DEMOS[1], bad=DEMOS[3],
                         scoring=Extended()).resume_key()
    del old["novelty"]
    assert config.upgrade_meta(old)["novelty"] == 3


def test_the_ray_actors_get_the_settings_unchanged(extended):
    pytest.importorskip("numpy")
    from icqs_fast.jobs.config import ScoreJobConfig
    from icqs_fast.jobs.ray_executor import ActorSetup
    from icqs_fast.jobs.runner import strategy_for

    config = ScoreJobConfig(input="-", output=os.devnull, good=DEMOS[1], bad=DEMOS[3],
                            scoring=Extended(novelty=4, num_ratios=3, demos_per_set=2,
                                             sets_per_ratio=2))
    strategy = strategy_for(config)
    strategy.prepare(lambda *a: None)
    assert strategy.settings is config.scoring  # the scorer's settings: the config's object
    # What the driver sends every actor (pickled once per actor); no dict round trip.
    setup = pickle.loads(pickle.dumps(ActorSetup(strategy, None, None, "out", None)))
    assert setup.strategy.settings == config.scoring and setup.strategy.settings.novelty == 4


def test_the_option_is_in_icqs_options_and_the_docs(extended):
    from icqs_fast.cli.options import options_docs
    from icqs_fast.options import options_table
    from icqs_fast.serve.schemas import icqs_options_model

    model = icqs_options_model()
    assert "novelty" in model.model_fields
    assert model(novelty=4).model_dump(exclude_none=True) == {"novelty": 4}
    schema = model.model_json_schema()["properties"]["novelty"]
    assert schema["minimum"] == 1 and schema["maximum"] == 9
    row = "| `--novelty N` | `3` | a new option, for this test |"
    assert row in options_table(Extended) and row in options_docs()


def test_out_of_bounds_gives_one_message_from_cli_and_server(extended, tmp_path, capsys):
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from icqs_fast.cli import main
    from icqs_fast.serve.errors import validation_error
    from icqs_fast.serve.schemas import icqs_options_model

    inp = tmp_path / "in.jsonl"
    inp.write_text('{"x": "q", "y": "positive"}\n')
    assert main(["score", str(inp), "-o", str(tmp_path / "o.jsonl"), *DEMOS,
                 "--novelty", "0"]) == 2
    cli = capsys.readouterr().err
    assert f"icqs-fast: error: {MESSAGE}\n" == cli
    with pytest.raises(ValidationError) as info:
        icqs_options_model().model_validate({"novelty": 0})
    # As the server turns a request's validation error into its 400 body.
    errors = [{**e, "loc": ("body", "icqs_options", *e["loc"])} for e in info.value.errors()]
    err = validation_error(RequestValidationError(errors))
    assert err.status == 400 and err.param == "icqs_options.novelty" and MESSAGE in err.message
    # The same for a declared option the server already had (the real request model).
    from icqs_fast.serve.schemas import ScoreRequest

    with pytest.raises(ValidationError) as info:
        ScoreRequest.model_validate({"records": [{"x": "q", "y": "a"}],
                                     "icqs_options": {"num_ratios": 1}})
    err = validation_error(RequestValidationError(
        [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]))
    assert main(["score", str(inp), "-o", str(tmp_path / "o.jsonl"), *DEMOS,
                 "--num-ratios", "1"]) == 2
    cli = capsys.readouterr().err.removeprefix("icqs-fast: error: ").strip()
    assert cli == "--num-ratios must be an int >= 2, got 1" and cli in err.message
