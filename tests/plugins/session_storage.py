"""A pytest plugin, registered by the root conftest.py: the session's runs go to a storage path of its own.

Without COURSE_STORAGE_PATH the lessons write to the default storage path, `<repo>/runs` (helpers.config), summaries
included (`<storage_path>/summaries/`): two test sessions on one machine, or a session beside a learner's lessons,
would read and overwrite each other's summaries. So at the start of the session, unless the user set
COURSE_STORAGE_PATH (in the environment or in the `.env` the lessons load), this plugin sets it to a new temporary
folder. Every notebook kernel and process the session starts inherits it: one path for the whole session, as lesson
02 reads the summary lesson 01 saved, and lesson 03 lesson 02's. The folder is deleted at the end of a session that
passed; a failed session keeps it and says where.

(Lesson 07's runtime env file goes to a temporary folder of its kernel's own, not into the repository, for the same
reason.)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import pytest
from dotenv import dotenv_values

from helpers.config import REPO_ROOT

VARIABLE = "COURSE_STORAGE_PATH"

_made: list[str] = []  # the folder this session made, if it made one


def set_by_user(environ: Mapping[str, str] = os.environ, notebooks: Path = REPO_ROOT / "notebooks") -> bool:
    """Whether COURSE_STORAGE_PATH is set in `environ`, or in the `.env` a lesson in `notebooks` would load
    (load_dotenv_file takes the first one from the notebook's folder upwards)."""
    if environ.get(VARIABLE):
        return True
    for folder in (notebooks, *notebooks.parents):
        if (folder / ".env").is_file():
            return bool(dotenv_values(folder / ".env").get(VARIABLE))
    return False


def made_for_this_session() -> str | None:
    """The folder this plugin made and set as COURSE_STORAGE_PATH, or None when the user set the path."""
    return _made[0] if _made else None


def pytest_sessionstart(session: pytest.Session) -> None:
    if set_by_user():
        return
    folder = tempfile.mkdtemp(prefix="course-storage-")
    _made.append(folder)
    os.environ[VARIABLE] = folder


@pytest.hookimpl(trylast=True)  # after leftover_processes, which ends what still runs and may fail the session
def pytest_sessionfinish(session: pytest.Session) -> None:
    for folder in _made:
        if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            shutil.rmtree(folder, ignore_errors=True)
        elif Path(folder).exists():
            print(f"\nThis session's runs and summaries ({VARIABLE}) are kept in {folder}")
