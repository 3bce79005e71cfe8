"""Ray Jobs against a real cluster on this machine (helpers.tooling.local_cluster), as lesson 07 uses it: a head with no
CPUs, one worker node, token auth on, the dashboard and its Jobs API on loopback.

Lesson 02's script is submitted for real through the REST API with `requests`, in smoke mode, with packages the
test zips and uploads itself: it must succeed, print its summary and leave its checkpoint on the storage path given
in its runtime env; the `ray` CLI then reports, lists and deletes it. A long job is stopped and its driver ends;
nothing is left running. (Lesson 07 itself, under nbval, trains through the CLI and the SDK and asserts their
outcome, stops a training run through REST, and shows the error of a job without a storage path.) Lesson 07's
exercises 1 and 2: their checks, run on this cluster, fail on the mistakes they target.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest
import requests
from ray.job_submission import JobStatus, JobSubmissionClient

from helpers.config import REPO_ROOT
from helpers.system import wait_until
from helpers.tooling.local_cluster import RAY_CLI, LocalCluster
from tests.support import clean_env, failed, lesson_cell, run_check_cell, running, stopped_after

pytestmark = pytest.mark.ray  # every test here uses the module's cluster

#: A training job of one worker on one CPU.
TRAIN = "train_ray_ddp.py --num-workers 1 --epochs 1"


@pytest.fixture(scope="module")
def cluster(no_ray) -> Iterator[LocalCluster]:
    """A head with no CPUs and one worker node; stopped after the module, and checked gone: its processes, listed
    just before it stops, include the drivers of jobs still running (children of the node's workers)."""
    with stopped_after(LocalCluster(worker_nodes=1, cpus_per_worker_node=2)) as local_cluster:
        yield local_cluster


@pytest.fixture(scope="module")
def auth(cluster: LocalCluster) -> dict[str, str]:
    return {"Authorization": f"Bearer {cluster.token}"}


@pytest.fixture(scope="module")
def client(cluster: LocalCluster, auth: dict[str, str]) -> JobSubmissionClient:
    return JobSubmissionClient(cluster.dashboard_url, headers=auth)


@pytest.fixture(scope="module")
def job_env(tmp_path_factory, small_mnist) -> dict[str, str]:
    """What a job needs that the cluster lacks: the storage path (outside the job's copy), the data, smoke mode."""
    return {"COURSE_STORAGE_PATH": str(tmp_path_factory.mktemp("job-storage")), "COURSE_DATA_DIR": small_mnist,
            "COURSE_SMOKE_TEST": "1", "COURSE_CPUS_PER_WORKER": "1", "PYTHONUNBUFFERED": "1"}


def cli(cluster: LocalCluster, *args: str, token: bool = True, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Run `ray job <args>` as a learner's terminal would: the address and, with `token`, RAY_AUTH_MODE=token."""
    env = clean_env(RAY_API_SERVER_ADDRESS=cluster.dashboard_url, RAY_AUTH_TOKEN_PATH=str(cluster.token_file))
    if token:
        env["RAY_AUTH_MODE"] = "token"
    return subprocess.run([str(RAY_CLI), "job", *args], env=env, cwd=REPO_ROOT / "notebooks", capture_output=True,
                          text=True, timeout=timeout_s)


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:  # ended meanwhile
        return []


def terminal_status(client: JobSubmissionClient, submission_id: str, timeout_s: float = 600) -> JobStatus:
    return wait_until(lambda: (s := client.get_job_status(submission_id)).is_terminal() and s, timeout_s, 1.0,
                      f"job {submission_id} ended")


def upload(cluster: LocalCluster, auth: dict[str, str], folder: Path, keep_name: bool = False) -> str:
    """Zip `folder`'s files (under its own name for a py_modules entry) and PUT them to the cluster; the gcs:// URI."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path in sorted(folder.rglob("*.py")):
            archive.write(path, path.relative_to(folder.parent if keep_name else folder))
    name = f"_ray_pkg_{hashlib.sha1(buffer.getvalue()).hexdigest()[:16]}.zip"
    response = requests.put(f"{cluster.dashboard_url}/api/packages/gcs/{name}", data=buffer.getvalue(),
                            headers=auth, timeout=60)
    assert response.status_code == 200, response.text
    return f"gcs://{name}"


class FinishedJob(NamedTuple):
    submission_id: str
    status: JobStatus
    logs: str


@pytest.fixture(scope="module")
def training_job(cluster: LocalCluster, auth: dict[str, str], job_env: dict[str, str],
                 client: JobSubmissionClient) -> FinishedJob:
    """Lesson 02's script submitted through REST, once it ended: its submission id, final status and logs (read
    here, so that no test depends on another's not having deleted the job yet)."""
    # Raw REST cannot send a local folder: zip it and PUT it to /api/packages/ first, as the SDK does. Each job gets
    # its own zips: a job that sets up a working_dir URI re-extracts it (Ray 2.60: overwrite=True), pulling the
    # folder from under a running job that uses the same URI.
    uploaded = {"working_dir": upload(cluster, auth, REPO_ROOT / "notebooks"),
                "py_modules": [upload(cluster, auth, REPO_ROOT / "helpers", keep_name=True)]}
    response = requests.post(f"{cluster.dashboard_url}/api/jobs/", headers=auth, timeout=30, json={
        "entrypoint": f"python {TRAIN}", "submission_id": "train-rest",
        "runtime_env": {"working_dir": uploaded["working_dir"], "py_modules": uploaded["py_modules"],
                        "env_vars": job_env}})
    assert response.status_code == 200, response.text
    assert response.json()["submission_id"] == "train-rest"
    status = terminal_status(client, "train-rest")
    return FinishedJob("train-rest", status, client.get_job_logs("train-rest"))


def test_the_jobs_api_answers_only_with_the_token(cluster: LocalCluster, auth: dict[str, str]) -> None:
    api = f"{cluster.dashboard_url}/api/jobs/"
    assert requests.get(api, timeout=30).status_code == 401
    assert requests.get(api, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 403
    assert requests.post(api, json={"entrypoint": "echo hi"}, timeout=30).status_code == 401
    assert requests.get(api, headers=auth, timeout=30).status_code == 200


def test_the_cli_sends_the_token_only_with_ray_auth_mode(cluster: LocalCluster) -> None:
    refused = cli(cluster, "list", token=False)
    assert refused.returncode != 0
    assert "Missing authentication token" in refused.stderr
    assert "RAY_AUTH_MODE is currently 'disabled'" in refused.stderr
    listed = cli(cluster, "list")
    assert listed.returncode == 0, listed.stderr


def test_a_training_job_succeeds_and_leaves_its_checkpoint_on_storage(
        training_job: FinishedJob, job_env: dict[str, str]) -> None:
    status, logs = training_job.status, training_job.logs
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    summary = [line for line in logs.splitlines() if line.startswith(("test_acc=", "checkpoint: ", "workers ran"))]
    heads = [line.split("=")[0].split(":")[0] for line in summary]
    assert heads == ["test_acc", "checkpoint", "workers ran on 1 node(s)"]
    checkpoint = Path(summary[1].removeprefix("checkpoint: "))
    assert checkpoint.is_relative_to(job_env["COURSE_STORAGE_PATH"]), "the checkpoint must be on the storage path"
    assert any(checkpoint.iterdir()), "the checkpoint folder is empty"


def test_the_cli_reports_status_and_logs(cluster: LocalCluster, training_job: FinishedJob,
                                         client: JobSubmissionClient) -> None:
    job_id = training_job.submission_id  # ended: the CLI reports it, then deletes it
    status = cli(cluster, "status", job_id)
    assert status.returncode == 0 and f"Job '{job_id}' succeeded" in status.stdout, status.stdout
    logs = cli(cluster, "logs", job_id, "--follow")
    assert logs.returncode == 0 and "test_acc=" in logs.stdout
    listed = cli(cluster, "list")
    assert f"submission_id='{job_id}'" in listed.stdout, listed.stdout[-2000:]
    deleted = cli(cluster, "delete", job_id)
    assert deleted.returncode == 0, deleted.stderr
    assert job_id not in [job.submission_id for job in client.list_jobs()]


def test_a_long_running_job_is_stopped_and_its_driver_ends(cluster: LocalCluster, client: JobSubmissionClient) -> None:
    # A driver that would run for 10 minutes; lesson 07 stops a training run the same way, through REST.
    entrypoint = "python -c 'import time; print(\"started\", flush=True); time.sleep(600)'"
    client.submit_job(entrypoint=entrypoint, submission_id="long")
    wait_until(lambda: "started" in client.get_job_logs("long"), 120, 1.0, "the driver started")
    # The driver among this cluster's own processes (a child of the worker that runs the job's supervisor).
    driver = [p for p in cluster.processes()
              if "python" in (_cmdline(p) or [""])[0] and "time.sleep(600)" in " ".join(_cmdline(p))]
    assert driver, "the job's driver process was not found among the cluster's processes"
    stopped = cli(cluster, "stop", "long")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert terminal_status(client, "long", timeout_s=120) == JobStatus.STOPPED
    wait_until(lambda: not any(running(p) for p in driver), 60, 1.0, "the driver process ended")
    response = requests.delete(f"{cluster.dashboard_url}/api/jobs/long",
                               headers={"Authorization": f"Bearer {cluster.token}"}, timeout=30)
    assert response.status_code == 200 and response.json() == {"deleted": True}


# ---- Lesson 07's exercises 1 and 2: each check, on this cluster, fed the typical mistakes and the solution ----------

@pytest.fixture
def lesson_07(cluster: LocalCluster, client: JobSubmissionClient) -> Iterator[dict]:
    """What lesson 07's cells leave for its exercises: `client`, `JobStatus` and the lesson's own wait_for_job; the
    exercise's jobs are stopped and deleted afterwards (a submission id can be used once)."""
    namespace: dict = {"client": client, "JobStatus": JobStatus, "JobSubmissionClient": JobSubmissionClient}
    exec(lesson_cell("07_ray_jobs.ipynb", "def wait_for_job("), namespace)
    before = {job.submission_id for job in client.list_jobs()}
    yield namespace
    for job in client.list_jobs():
        if job.submission_id not in before:
            client.stop_job(job.submission_id)
            terminal_status(client, job.submission_id, timeout_s=60)
            client.delete_job(job.submission_id)
    # delete_job keeps the job's log file, and a new job of the same submission id appends to it (Ray 2.60): the next
    # answer's check would read this one's lines. Remove them, as a fresh cluster would not have them.
    assert cluster.temp_dir is not None
    for log in cluster.temp_dir.glob("session_*/logs/job-driver-*.log"):
        if log.name.removeprefix("job-driver-").removesuffix(".log") not in before:
            log.unlink()


SUBMIT = 'exercise_1_job = client.submit_job(entrypoint={entrypoint!r}{runtime_env})\n'
WITH_ENV = ', runtime_env={"env_vars": {"GREETING": "hello"}}'
PRINTED = "it printed the line hello, and only that"


@pytest.mark.parametrize("answer,wrong", [
    (SUBMIT.format(entrypoint="echo $GREETING", runtime_env=WITH_ENV), []),
    (SUBMIT.format(entrypoint='echo "${GREETING}"', runtime_env=WITH_ENV), []),  # the same command, spelled out
    (SUBMIT.format(entrypoint="GREETING=hello echo $GREETING", runtime_env=""),  # the shell expands it first: ""
     ["it runs echo $GREETING", "its runtime env sets GREETING=hello", PRINTED]),
    ('os.environ["GREETING"] = "hello"\n'  # this process's environment, not the cluster's
     + SUBMIT.format(entrypoint="echo $GREETING", runtime_env=""),
     ["its runtime env sets GREETING=hello", PRINTED]),
    (SUBMIT.format(entrypoint="echo GREETING", runtime_env=WITH_ENV), ["it runs echo $GREETING", PRINTED]),  # no $
    (SUBMIT.format(entrypoint="echo hello", runtime_env=WITH_ENV), ["it runs echo $GREETING"]),  # typed, not read
    # The id of another job: the first try's, kept from before.
    ('first_try = client.submit_job(entrypoint="echo GREETING")\n'
     + SUBMIT.format(entrypoint="echo $GREETING", runtime_env=WITH_ENV) + "exercise_1_job = first_try\n",
     ["it runs echo $GREETING", "its runtime env sets GREETING=hello", PRINTED]),
    ('client.submit_job(entrypoint="echo $GREETING"' + WITH_ENV + ")\n", ["exercise_1_job holds the job's id",
     "the job succeeds", "it runs echo $GREETING", "its runtime env sets GREETING=hello", PRINTED]),  # not kept
])
def test_lesson_07_exercise_1_fails_when_greeting_is_not_in_the_runtime_env(lesson_07, capsys, answer, wrong,
                                                                            monkeypatch):
    monkeypatch.setenv("GREETING", "")  # recorded as it was before (unset), to be put back whatever the answer sets
    monkeypatch.delenv("GREETING")
    lesson_07["os"] = os
    lesson_07["exercise_1_job"] = ...  # the exercise's cell as given
    exec(answer, lesson_07)
    results = run_check_cell("07_ray_jobs.ipynb", "exercise_1", lesson_07, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


@pytest.fixture(scope="module")
def finished_job_of_section_05(client: JobSubmissionClient) -> str:
    """Section 05's job `lesson07-one-cpu`, finished, which exercise 2's check reads: submitted once for the module,
    before `lesson_07` notes the jobs to keep (a job submitted again under an id just deleted can fail in Ray 2.60:
    its supervisor actor's name is still taken)."""
    client.submit_job(entrypoint="echo hello", submission_id="lesson07-one-cpu")
    assert terminal_status(client, "lesson07-one-cpu", timeout_s=120) == JobStatus.SUCCEEDED
    return "lesson07-one-cpu"


WAIT_FOR_STOPPED = """
client.stop_job(submission_id)
deadline = time.monotonic() + timeout_s
while client.get_job_status(submission_id) != JobStatus.STOPPED:
    if time.monotonic() > deadline:
        raise TimeoutError(f"{submission_id} is not STOPPED")
    time.sleep(1)
return JobStatus.STOPPED"""


@pytest.mark.parametrize("body,wrong", [
    ("client.stop_job(submission_id)\nreturn wait_for_job(client, submission_id, timeout_s)", []),
    ("return wait_for_job(client, submission_id, timeout_s)", ["a running job ends STOPPED"]),  # never stopped
    ("client.stop_job(submission_id)\nreturn JobStatus.STOPPED", ["a finished job keeps its status"]),  # no wait
    (WAIT_FOR_STOPPED, ["a finished job keeps its status"]),  # waits for STOPPED, which a finished job never becomes
])
def test_lesson_07_exercise_2_fails_when_not_stopped_or_a_finished_job_is_called_stopped(finished_job_of_section_05,
                                                                                        lesson_07, capsys, body,
                                                                                        wrong):
    # A 5 s default instead of the exercise's 60: a wrong answer that waits gives up sooner, as it would at 60.
    exec("import time\ndef stop_and_wait(client, submission_id, timeout_s=5):\n"
         + "\n".join("    " + line for line in body.strip().splitlines()), lesson_07)
    results = run_check_cell("07_ray_jobs.ipynb", "exercise_2", lesson_07, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results
