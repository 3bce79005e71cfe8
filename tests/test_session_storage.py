"""The plugin tests/plugins/session_storage.py gives the session a storage path of its own, unless the user set one."""

from __future__ import annotations

import os
from pathlib import Path

from helpers.config import REPO_ROOT, load_config
from tests.plugins.session_storage import VARIABLE, made_for_this_session, set_by_user


def test_a_variable_or_a_dotenv_above_the_notebooks_counts_as_set_by_the_user(tmp_path: Path) -> None:
    notebooks = tmp_path / "repo" / "notebooks"
    notebooks.mkdir(parents=True)
    assert not set_by_user({}, notebooks)
    assert set_by_user({VARIABLE: "/mnt/shared/runs"}, notebooks)
    (tmp_path / ".env").write_text(f"{VARIABLE}=/mnt/shared/runs\n")
    assert set_by_user({}, notebooks), "a .env further up is the one load_dotenv_file loads"
    (tmp_path / "repo" / ".env").write_text("COURSE_SMOKE_TEST=1\n")
    assert not set_by_user({}, notebooks), "the nearest .env is the one loaded, and it does not set the path"


def test_this_session_writes_its_runs_outside_the_repository() -> None:
    storage_path = load_config().storage_path  # what setup() and the notebooks' kernels see
    made = made_for_this_session()
    if made is None:  # the user named one, in the environment or the .env: theirs stays
        assert set_by_user(), "the plugin made no folder although the user set no storage path"
    else:
        assert storage_path == made and os.environ[VARIABLE] == made
        assert Path(made).is_dir() and not Path(made).is_relative_to(REPO_ROOT)
