"""helpers.session without Ray: the token sent on joining a cluster, logger_level, the runtime env a job's
driver gets, and the names lessons, scripts and tests import from it.

setup() and its Ray for real: tests/test_session_ray.py.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

from helpers import load_config
from helpers.session import logger_level, runtime_env


def _token_mode_after_join_preparation(tmp_path, **env: str) -> str:
    """RAY_AUTH_MODE after `send_token_if_given()`, in a fresh process with `env` and an empty home folder."""
    code = "import os; from helpers.session import send_token_if_given; send_token_if_given(); " \
           "print(os.environ.get('RAY_AUTH_MODE', 'unset'))"
    clean = {key: value for key, value in os.environ.items() if not key.startswith("RAY_AUTH")}
    done = subprocess.run([sys.executable, "-c", code], env={**clean, "HOME": str(tmp_path), **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_given_token_is_sent_when_joining_a_cluster(tmp_path):
    # Ray sends a token only with RAY_AUTH_MODE=token; with RAY_AUTH_TOKEN alone, joining a token-auth cluster fails.
    assert _token_mode_after_join_preparation(tmp_path, RAY_AUTH_TOKEN="0123abcd") == "token"
    token_file = tmp_path / "token"
    token_file.write_text("0123abcd")
    assert _token_mode_after_join_preparation(tmp_path, RAY_AUTH_TOKEN_PATH=str(token_file)) == "token"
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("0123abcd")  # where `ray start` and ray.init() keep theirs
    assert _token_mode_after_join_preparation(tmp_path) == "token"


def test_no_token_or_an_explicit_mode_is_left_alone(tmp_path):
    assert _token_mode_after_join_preparation(tmp_path) == "unset"
    assert _token_mode_after_join_preparation(tmp_path, RAY_AUTH_TOKEN="0123abcd", RAY_AUTH_MODE="disabled") == \
        "disabled"


def test_logger_level_keeps_lower_records_out_inside_and_restores_the_level(caplog):
    logger = logging.getLogger("course.test.logger_level")
    logger.setLevel(logging.INFO)
    with caplog.at_level(logging.DEBUG, logger=logger.name), logger_level(logger.name, logging.ERROR):
        logger.warning("kept out")
        logger.error("let through")
    assert [record.getMessage() for record in caplog.records] == ["let through"]
    assert logger.level == logging.INFO


def test_what_lessons_scripts_and_tests_import_from_session_stays_there_after_the_split():
    """helpers.auth and helpers.logs were part of helpers.session: every name it had stays importable from it."""
    from helpers import auth, logs, session

    for name in ("DEFAULT_TOKEN_FILE", "TOKEN_VARS", "send_token_if_given", "token_auth_state", "token_source"):
        assert getattr(session, name) is getattr(auth, name)
    for name in ("CPU_RACE_WAIT_S", "RAY_INTERNAL_WARNINGS", "WORKER_ENV_DEFAULTS", "logger_level"):
        assert getattr(session, name) is getattr(logs, name)
    # Ray imports the hook by this name in every worker it starts.
    assert session.runtime_env(load_config({}))["worker_process_setup_hook"] == "helpers.session.quiet_worker_logs"


def test_the_courses_runtime_env_leaves_the_jobs_own_settings_to_the_job(monkeypatch) -> None:
    # What the course's scripts pass to ray.init inside a job: Ray refuses to merge fields or variables set twice.
    from helpers.config import load_config

    job = {"working_dir": "gcs://_ray_pkg_0.zip", "py_modules": ["gcs://_ray_pkg_1.zip"],
           "env_vars": {"COURSE_STORAGE_PATH": "/shared", "COURSE_SMOKE_TEST": "1"}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": job}))
    ours = runtime_env(load_config({"COURSE_STORAGE_PATH": "/shared"}))
    assert "py_modules" not in ours and "working_dir" not in ours
    assert "worker_process_setup_hook" not in ours, "the hook imports helpers, which only py_modules would ship"
    assert not set(ours["env_vars"]) & set(job["env_vars"]), "variables set twice make ray.init fail"
    assert "COURSE_DATA_DIR" in ours["env_vars"], "the settings the job does not set still reach the workers"
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")
    assert set(runtime_env(load_config({}))) == {"py_modules", "env_vars", "worker_process_setup_hook"}
