"""The option table, the loader and `Config` (src/notesvc/settings.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HERE, notesvc


class TestConfig:
    def test_defaults_match_the_contract(self):
        cfg = notesvc.load_config(env={})
        assert (cfg.host, cfg.port, cfg.auth_mode, cfg.pairing) == (
            "0.0.0.0",
            3000,
            "api-key",
            "relay",
        )
        assert cfg.max_body_bytes == 1048576
        assert cfg.rescan_seconds == 5
        assert cfg.threads == 8
        assert cfg.agent_timeout == 60
        assert cfg.root == Path("./data").resolve()

    def test_flag_beats_variable_beats_default(self):
        assert notesvc.load_config(env={"SERVICE_PORT": "4000"}).port == 4000
        assert notesvc.load_config(env={"SERVICE_PORT": "4000"}, port="5000").port == 5000

    @pytest.mark.parametrize(
        ("env", "names"),
        [
            ({"SERVICE_PORT": "abc"}, "SERVICE_PORT"),
            ({"SERVICE_PORT": "70000"}, "SERVICE_PORT"),
            ({"SERVICE_AUTH_MODE": "magic"}, "SERVICE_AUTH_MODE"),
            ({"SERVICE_AUTH_MODE": "jwt"}, "SERVICE_JWT_SECRET"),
            ({"SERVICE_AUTH_MODE": "jwt", "SERVICE_JWT_SECRET": "short"}, "SERVICE_JWT_SECRET"),
            ({"SERVICE_TRUST_PROXY": "maybe"}, "SERVICE_TRUST_PROXY"),
            ({"SERVICE_PAIRING_MODE": "carrier-pigeon"}, "SERVICE_PAIRING_MODE"),
            ({"SERVICE_PUBLIC_URL": "ftp://x"}, "SERVICE_PUBLIC_URL"),
            ({"SERVICE_CORS_ORIGINS": "not a url"}, "SERVICE_CORS_ORIGINS"),
            ({"SERVICE_MAX_BODY_BYTES": "-1"}, "SERVICE_MAX_BODY_BYTES"),
            ({"SERVICE_AGENT_TIMEOUT": "soon"}, "SERVICE_AGENT_TIMEOUT"),
            ({"SERVICE_THREADS": "0"}, "SERVICE_THREADS"),
            ({"SERVICE_LOG_LEVEL": "loud"}, "SERVICE_LOG_LEVEL"),
        ],
    )
    def test_bad_value_raises_config_error_naming_it(self, env, names):
        with pytest.raises(notesvc.ConfigError, match=names):
            notesvc.load_config(env=env)

    def test_jwt_with_long_secret_is_accepted(self):
        cfg = notesvc.load_config(env={"SERVICE_AUTH_MODE": "jwt", "SERVICE_JWT_SECRET": "x" * 32})
        assert cfg.auth_mode == "jwt"

    def test_every_setting_is_a_config_field(self):
        fields = {f.name for f in notesvc.dataclasses.fields(notesvc.Config)}
        assert {s.name for s in notesvc.SETTINGS} == fields

    @pytest.mark.slow
    def test_importing_the_module_creates_no_files(self, tmp_path):
        code = "import notesvc, os; print(sorted(os.listdir('.')))"
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(HERE)},
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == "[]"
