from pathlib import Path

import pytest

from pipelinerl.config import ConfigError, load_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_defaults_and_dotted_overrides():
    cfg = load_config(None, ["trainer.lr=3e-5", "engine.temperature=0.7", "actor.max_lag=2"])
    assert cfg.trainer.lr == pytest.approx(3e-5)
    assert cfg.engine.temperature == pytest.approx(0.7)
    assert cfg.actor.max_lag == 2


def test_unknown_key_names_the_key_and_value():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.lrr=1e-4"])
    assert "trainer.lrr" in str(err.value) and "unknown key" in str(err.value)
    assert "0.0001" in str(err.value)


def test_bad_value_names_key_value_and_expectation():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.lr=fast"])
    msg = str(err.value)
    assert "trainer.lr" in msg and "'fast'" in msg and "number" in msg
    with pytest.raises(ConfigError) as err:
        load_config(None, ["engine.backend=tensorrt"])
    assert "engine.backend" in str(err.value) and "'torch'" in str(err.value)


def test_cross_field_check():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.batch_size=60", "actor.group_size=8"])
    assert "multiple of" in str(err.value)


def test_configs_that_cannot_make_progress_are_refused_naming_the_keys():
    with pytest.raises(ConfigError, match=r"engine\.capacity.*actor\.group_size"):
        load_config(None, ["engine.capacity=4", "actor.group_size=8", "trainer.batch_size=16"])
    with pytest.raises(ConfigError, match=r"trainer\.publish_every.*actor\.max_lag"):
        load_config(None, ["trainer.publish_every=3", "actor.max_lag=1"])
    # Conventional mode publishes once per round whatever publish_every says.
    load_config(None, ["mode=conventional", "trainer.publish_every=3", "actor.max_lag=0"])


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["trainer.lr"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate(path):
    load_config(path)


def test_overrides_may_come_before_and_after_the_overwrite_flag(monkeypatch) -> None:
    import pipelinerl.roles.launch
    from pipelinerl.cli import main

    seen: dict = {}
    monkeypatch.setattr(pipelinerl.roles.launch, "launch",
                        lambda cfg, **kw: seen.update(cfg=cfg, **kw) or 0)
    example = str(Path(__file__).resolve().parents[1] / "examples" / "arithmetic.yaml")
    assert main(["train", example, "trainer.lr=1e-5", "--overwrite", "name=x"]) == 0
    assert seen["overwrite"] and seen["cfg"].name == "x" and seen["cfg"].trainer.lr == 1e-5
    # The command that continues the run, shown after a failure, keeps the overrides.
    assert seen["resume_command"] == f"pipelinerl train {example} trainer.lr=1e-5 name=x --resume"
    assert main(["train", example, "--resume", "--auto-resume", "name=x"]) == 0
    assert seen["resume"] and seen["cfg"].trainer.max_restarts == 3
    with pytest.raises(SystemExit):  # one or the other
        main(["train", example, "--resume", "--overwrite"])
    with pytest.raises(SystemExit):  # argparse's usage error: an unknown option stays one
        main(["train", example, "--overwrite", "--bogus", "name=x"])


def test_digits_only_text_overrides_keep_their_text() -> None:
    cfg = load_config(None, ["run_id=0123", "name=2024", "trainer.lr=1e-4"])
    assert cfg.run_id == "0123"
    assert cfg.name == "2024"
    assert cfg.trainer.lr == 1e-4
