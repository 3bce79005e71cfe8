"""helpers.config: parsing, validation errors, .env loading."""

from __future__ import annotations

import dataclasses
import os
from unittest.mock import patch

import pytest

from helpers import config as config_module
from helpers.config import REPO_ROOT, ConfigError, load_config, load_dotenv_file


def test_defaults_without_any_variable(tmp_path, monkeypatch):
    monkeypatch.setattr(config_module, "CLUSTER_STORAGE", tmp_path / "absent")
    cfg = load_config({})
    assert cfg.smoke_test is False and cfg.mode == "full"
    assert cfg.data_dir == REPO_ROOT / "data"
    assert cfg.storage_path == str(REPO_ROOT / "runs")
    assert cfg.num_workers is None, "unset: setup() sizes the run for the cluster"
    assert cfg.use_gpu == "auto"
    assert cfg.cpus_per_worker is None
    assert cfg.accelerator_type is None
    assert cfg.ray_address is None


def test_storage_defaults_to_cluster_storage_when_mounted(tmp_path, monkeypatch):
    monkeypatch.setattr(config_module, "CLUSTER_STORAGE", tmp_path)
    assert load_config({}).storage_path == str(tmp_path / "ray-train-course")


@pytest.mark.parametrize(("raw", "expected"), [("1", True), ("true", True), ("YES", True), ("on", True),
                                               ("0", False), ("False", False), ("no", False), ("", False)])
def test_smoke_test_values(raw, expected):
    cfg = load_config({"COURSE_SMOKE_TEST": raw})
    assert cfg.smoke_test is expected
    assert cfg.mode == ("smoke" if expected else "full")


@pytest.mark.parametrize(("raw", "expected"), [("auto", "auto"), ("", "auto"), ("1", True), ("true", True),
                                               ("0", False), ("off", False)])
def test_use_gpu_values(raw, expected):
    assert load_config({"COURSE_USE_GPU": raw}).use_gpu == expected


def test_explicit_values_and_relative_paths(tmp_path):
    cfg = load_config({
        "COURSE_DATA_DIR": str(tmp_path / "datasets"),
        "COURSE_STORAGE_PATH": "some/runs",
        "COURSE_NUM_WORKERS": " 4 ",
        "RAY_ADDRESS": "ray://head:10001",
    })
    assert cfg.data_dir == tmp_path / "datasets"
    assert cfg.storage_path == str(REPO_ROOT / "some" / "runs")  # relative to the repository, not the cwd
    assert cfg.num_workers == 4
    assert cfg.ray_address == "ray://head:10001"


@pytest.mark.parametrize(("name", "raw", "accepted"), [
    ("COURSE_SMOKE_TEST", "maybe", "1, true, yes, on, 0, false, no, off"),
    ("COURSE_USE_GPU", "sometimes", "auto (detect), true/1 or false/0"),
    ("COURSE_NUM_WORKERS", "two", "whole number >= 1"),
    ("COURSE_NUM_WORKERS", "0", "whole number >= 1"),
    ("COURSE_NUM_WORKERS", "-3", "whole number >= 1"),
    ("COURSE_NUM_WORKERS", "1.5", "whole number >= 1"),
    ("COURSE_CPUS_PER_WORKER", "many", "number of CPUs > 0"),
    ("COURSE_CPUS_PER_WORKER", "0", "number of CPUs > 0"),
    ("COURSE_CPUS_PER_WORKER", "-1", "number of CPUs > 0"),
    ("COURSE_DATA_DIR", "s3://bucket/data", "use a local folder"),
    ("COURSE_ACCELERATOR_TYPE", "T4; rm -rf", "accelerator type such as T4"),
])
def test_malformed_values_name_the_variable_and_the_accepted_values(name, raw, accepted):
    with pytest.raises(ConfigError) as error:
        load_config({name: raw})
    message = str(error.value)
    assert name in message and repr(raw) in message and accepted in message


def test_a_file_is_not_a_valid_folder(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="COURSE_DATA_DIR=.*names a file"):
        load_config({"COURSE_DATA_DIR": str(a_file)})


def test_config_is_frozen():
    cfg = load_config({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_workers = 8  # type: ignore[misc]


def test_storage_uris_stay_uris(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for uri in ("s3://my-bucket/course", "s3://my-bucket/course/", "gs://bucket/course"):
        assert load_config({"COURSE_STORAGE_PATH": uri}).storage_path == uri.rstrip("/")
    assert not (tmp_path / "s3:").exists() and not (REPO_ROOT / "s3:").exists()


def test_cpus_per_worker_values():
    assert load_config({"COURSE_CPUS_PER_WORKER": "4"}).cpus_per_worker == 4.0
    assert load_config({"COURSE_CPUS_PER_WORKER": " 0.5 "}).cpus_per_worker == 0.5


def test_as_env_round_trips(tmp_path):
    cfg = load_config({"COURSE_SMOKE_TEST": "1", "COURSE_DATA_DIR": str(tmp_path), "COURSE_NUM_WORKERS": "3",
                       "COURSE_USE_GPU": "false", "COURSE_CPUS_PER_WORKER": "1.5",
                       "COURSE_STORAGE_PATH": "s3://bucket/course"})
    assert load_config(cfg.as_env()) == cfg
    assert set(cfg.as_env()) == {"COURSE_SMOKE_TEST", "COURSE_DATA_DIR", "COURSE_DATA_DOWNLOAD", "COURSE_STORAGE_PATH",
                                 "COURSE_NUM_WORKERS", "COURSE_USE_GPU", "COURSE_CPUS_PER_WORKER",
                                 "COURSE_ACCELERATOR_TYPE"}
    assert load_config(load_config({}).as_env()) == load_config({}), "unset values stay unset"
    with_accelerator = load_config({"COURSE_ACCELERATOR_TYPE": "T4"})
    assert with_accelerator.accelerator_type == "T4"
    assert load_config(with_accelerator.as_env()) == with_accelerator


def test_data_downloads_are_on_unless_turned_off_and_reach_the_workers():
    assert load_config({}).data_download is True
    assert load_config({}).as_env()["COURSE_DATA_DOWNLOAD"] == "", "the default stays unset (lesson 07 prints the set)"
    off = load_config({"COURSE_DATA_DOWNLOAD": "0"})
    assert off.data_download is False and off.as_env()["COURSE_DATA_DOWNLOAD"] == "0"
    assert load_config(off.as_env()) == off
    with pytest.raises(ConfigError, match="COURSE_DATA_DOWNLOAD='never' is not valid"):
        load_config({"COURSE_DATA_DOWNLOAD": "never"})


def test_lesson_08s_settings_are_read_with_the_others(tmp_path):
    unset = load_config({})
    assert (unset.kuberay_dir, unset.kubernetes) == (None, False)
    cfg = load_config({"COURSE_KUBERAY_DIR": str(tmp_path), "COURSE_KUBERNETES": "1"})
    assert (cfg.kuberay_dir, cfg.kubernetes) == (tmp_path.resolve(), True)
    assert load_config({"COURSE_KUBERAY_DIR": "kuberay"}).kuberay_dir == REPO_ROOT / "kuberay"  # as COURSE_DATA_DIR
    with pytest.raises(ConfigError, match="COURSE_KUBERNETES='maybe' is not valid"):
        load_config({"COURSE_KUBERNETES": "maybe"})
    assert "COURSE_KUBERAY_DIR" not in cfg.as_env(), "read where lesson 08 runs, not in Ray's workers"


@pytest.fixture
def environ_restored():
    """python-dotenv writes what it loads into os.environ, where monkeypatch does not see it: put os.environ back
    as it was, so no COURSE_* value from a test's .env reaches later tests (or the drivers they start)."""
    with patch.dict(os.environ):
        yield


def test_dotenv_file_is_read_and_the_environment_wins(tmp_path, monkeypatch, environ_restored):
    dotenv = tmp_path / ".env"
    dotenv.write_text("COURSE_NUM_WORKERS=3\nCOURSE_SMOKE_TEST=1\n")
    monkeypatch.delenv("COURSE_NUM_WORKERS", raising=False)
    monkeypatch.setenv("COURSE_SMOKE_TEST", "0")
    assert load_dotenv_file(dotenv) == dotenv
    cfg = load_config()
    assert cfg.num_workers == 3  # from .env
    assert cfg.smoke_test is False  # the real environment variable wins over .env


def test_dotenv_is_found_from_a_subfolder(tmp_path, monkeypatch, environ_restored):
    (tmp_path / ".env").write_text("COURSE_NUM_WORKERS=5\n")
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    monkeypatch.delenv("COURSE_NUM_WORKERS", raising=False)
    assert load_dotenv_file() == tmp_path / ".env"
    assert load_config().num_workers == 5


def test_env_example_documents_every_variable():
    documented = (REPO_ROOT / ".env.example").read_text()
    for name in [*load_config({}).as_env(), "RAY_ADDRESS"]:
        assert f"# {name}=" in documented, f"{name} is missing from .env.example"


def test_a_storage_path_inside_a_ray_jobs_temporary_working_dir_is_refused():
    # `ray job submit --working-dir .` runs the scripts in Ray's copy of the repository: <repo>/runs would be in it.
    job_copy = "/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_0"
    with pytest.raises(ConfigError, match="inside Ray's copy of this job's working_dir, which other jobs share"):
        load_config({"COURSE_STORAGE_PATH": f"{job_copy}/runs"})
    assert load_config({"COURSE_STORAGE_PATH": "/mnt/shared/runs"}).storage_path == "/mnt/shared/runs"
