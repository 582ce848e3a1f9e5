"""The settings schema: defaults, MC_* environment, CLI precedence, validation."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from orchestrator import settings as s


def test_every_setting_has_help_and_a_flag():
    parser = argparse.ArgumentParser()
    s.add_flags(parser)
    flags = {a.dest for a in parser._actions}
    for f in dataclasses.fields(s.Settings):
        assert len(f.metadata["help"]) > 20, f.name
        assert f.name in flags


def test_env_overrides_defaults_and_cli_overrides_env():
    env = {"MC_PORT": "9000", "MC_CTX": "4096", "MC_OFFLINE": "yes"}
    assert s.Settings.load({}, env).port == 9000
    assert s.Settings.load({}, env).offline is True
    loaded = s.Settings.load({"port": 9100}, env)
    assert (loaded.port, loaded.ctx) == (9100, 4096)


def test_validation_names_the_setting_and_the_allowed_values():
    with pytest.raises(s.SettingsError, match=r"flash_attn: must be one of auto, on, off \(got 'maybe'\)"):
        s.Settings(flash_attn="maybe")
    with pytest.raises(s.SettingsError, match="ctx: must be between 256 and"):
        s.Settings(ctx=10)
    with pytest.raises(s.SettingsError, match="MC_OFFLINE: must be true or false"):
        s.Settings.load({}, {"MC_OFFLINE": "perhaps"})
