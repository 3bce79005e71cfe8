"""Lesson 08's commands for a real cluster, run here against a fake `kubectl` (and fake `ray`, `helm`, `docker`,
`openssl`) on PATH: the RayJob wait ends on every state KubeRay can report, with the reason, or at its timeout; every
command the lesson prints carries a time limit; the token never appears in any command's arguments."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from helpers.config import REPO_ROOT
from helpers.tooling import kuberay

WAIT = kuberay.DEPLOY_DIR / "wait.sh"
TOKEN = "5f" * 32  # what the fake `openssl rand -hex 32` prints, and the fake Secret holds

FAKE_KUBECTL = r"""#!/usr/bin/env bash
# Records its arguments (and what it reads from /dev/stdin); answers `get rayjob` and `get job` from $FAKE_DIR/states,
# one line per call (the last one stays), and `get secret` with the token.
printf '%s\n' "$(printf '%s\x1f' "$@")" >> "$FAKE_DIR/kubectl.log"
for arg in "$@"; do [[ "$arg" == *=/dev/stdin ]] && cat > "$FAKE_DIR/stdin"; done
if [[ "$1 $2" == "get rayjob" || "$1 $2" == "get job" ]]; then
  [[ -e "$FAKE_DIR/missing" ]] && { echo "Error from server (NotFound): rayjobs.ray.io \"$3\" not found" >&2; exit 1; }
  case "$*" in
    *jobDeploymentStatus* | *'?(@.status=="True")'*)
      head -n 1 "$FAKE_DIR/states"
      if [[ $(wc -l < "$FAKE_DIR/states") -gt 1 ]]; then
        tail -n +2 "$FAKE_DIR/states" > "$FAKE_DIR/states.next" && mv "$FAKE_DIR/states.next" "$FAKE_DIR/states"
      fi ;;
    *reason*) cat "$FAKE_DIR/reason" 2>/dev/null ;;
    *message*) cat "$FAKE_DIR/message" 2>/dev/null ;;
  esac
elif [[ "$1 $2" == "get secret" ]]; then
  printf '%s' "$FAKE_TOKEN" | base64
fi
exit 0
"""
FAKE_RECORDER = r"""#!/usr/bin/env bash
# Records its name, arguments and RAY_AUTH_TOKEN; prints what `openssl rand -hex 32` would.
printf '%s\n' "$(basename "$0")$(printf '\x1f%s' "$@")" >> "$FAKE_DIR/commands.log"
printf '%s\n' "${RAY_AUTH_TOKEN:-}" >> "$FAKE_DIR/ray-env.log"
[[ "$(basename "$0") $1" == "openssl rand" ]] && printf '%s\n' "$FAKE_TOKEN"
exit 0
"""


@pytest.fixture
def fakes(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH finds the fakes first; their logs go to tmp_path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(FAKE_KUBECTL)
    for name in ("ray", "helm", "docker", "openssl"):
        (bin_dir / name).write_text(FAKE_RECORDER)
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path), "FAKE_TOKEN": TOKEN,
            "HOME": str(tmp_path), "WAIT_POLL_S": "0.05"}


def wait(fakes: dict[str, str], states: list[str], *args: str, reason: str = "", message: str = "",
         kind: str = "rayjob", timeout_s: float = 60) -> subprocess.CompletedProcess:
    fake_dir = Path(fakes["FAKE_DIR"])
    (fake_dir / "states").write_text("".join(f"{state}\n" for state in states))
    (fake_dir / "reason").write_text(reason)
    (fake_dir / "message").write_text(message)
    return subprocess.run([str(WAIT), kind, "ray-course-train", *args], env=fakes, capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO_ROOT)


#: KubeRay v1.7.0's JobDeploymentStatus values (ray-operator/apis/ray/v1/rayjob_types.go), all ten: those the wait
#: ends on (the tests below), and those on the way ("" is a RayJob the operator has not seen yet).
ENDINGS = ["Complete", "Failed", "ValidationFailed", "Suspended"]
ON_THE_WAY = ["", "Initializing", "Waiting", "Running", "Retrying", "Suspending"]


def test_a_job_that_succeeds_ends_the_wait_with_0(fakes):
    done = wait(fakes, [" ", "Initializing ", "Running RUNNING", "Running RUNNING", "Complete SUCCEEDED"])
    assert done.returncode == 0, done.stderr
    steps = [line.split(": ", 1)[1] for line in done.stdout.splitlines()]
    assert steps == ["(no status yet)", "Initializing", "Running RUNNING", "Complete SUCCEEDED"]


ENDING_CASES = [
    (["Initializing ", "ValidationFailed "], "ValidationFailed",
     "The RayJob spec is invalid default/ray-course-train: ..."),
    (["Running RUNNING", "Failed FAILED"], "AppFailed", "Job entrypoint command failed with exit code 1"),
    (["Initializing ", "Failed "], "DeadlineExceeded",
     "The RayJob has passed the activeDeadlineSeconds. StartTime: ... ActiveDeadlineSeconds: 7200"),
    (["Running RUNNING", "Failed "], "SubmissionFailed", "Job submission has failed. Reason: BackoffLimitExceeded."),
    (["Running RUNNING", "Complete FAILED"], "AppFailed", "Job entrypoint command failed with exit code 1"),
    (["Running RUNNING", "Complete STOPPED"], "", ""),
    (["Suspending ", "Suspended "], "", ""),
]


def test_the_endings_below_are_all_of_kuberay_s():
    assert {states[-1].split()[0] for states, _, _ in ENDING_CASES} == set(ENDINGS)
    assert sorted(ENDINGS + ON_THE_WAY) == sorted(["", "Initializing", "Running", "Complete", "Failed",
                                                   "ValidationFailed", "Suspending", "Suspended", "Retrying",
                                                   "Waiting"])


@pytest.mark.parametrize("states, reason, message", ENDING_CASES, ids=[
    "ValidationFailed", "Failed:AppFailed", "Failed:DeadlineExceeded", "Failed:SubmissionFailed", "Complete:FAILED",
    "Complete:STOPPED", "Suspended"])
def test_every_other_ending_ends_the_wait_with_1_and_the_reason(fakes, states, reason, message):
    start = time.monotonic()
    done = wait(fakes, states, reason=reason, message=message)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == f"reason: {reason} | message: {message}"
    assert time.monotonic() - start < 10


def test_the_states_on_the_way_keep_it_waiting_until_its_timeout(fakes):
    for state in ON_THE_WAY:
        start = time.monotonic()
        done = wait(fakes, [f"{state} RUNNING" if state == "Running" else f"{state} "], "1")
        assert done.returncode == 124, (state, done.stdout, done.stderr)
        last = f"{state} RUNNING" if state == "Running" else state or "none"
        assert f"rayjob ray-course-train has not ended after 1s (last status: {last})" in done.stderr
        assert time.monotonic() - start < 10


def test_a_rayjob_that_cannot_be_read_ends_the_wait_with_kubectl_s_error(fakes):
    (Path(fakes["FAKE_DIR"]) / "missing").touch()
    done = wait(fakes, ["Running RUNNING"])
    assert done.returncode == 1
    assert 'rayjob ray-course-train cannot be read: Error from server (NotFound): rayjobs.ray.io "ray-course-train" ' \
           'not found' in done.stderr


@pytest.mark.parametrize("states, reason, message, code", [
    (["", "SuccessCriteriaMet", "SuccessCriteriaMet Complete"], "", "", 0),
    (["", "FailureTarget Failed"], "BackoffLimitExceeded", "Job has reached the specified backoff limit", 1),
    (["Suspended"], "JobSuspended", "Job suspended", 1),
], ids=["Complete", "Failed", "Suspended"])
def test_the_data_job_s_wait_ends_on_its_conditions(fakes, states, reason, message, code):
    done = wait(fakes, states, kind="job", reason=reason, message=message)
    assert done.returncode == code, done.stdout + done.stderr
    last = done.stdout.splitlines()[-1]
    expected = f"reason: {reason} | message: {message}"
    assert last.endswith(": SuccessCriteriaMet Complete") if code == 0 else last == expected


def test_a_job_still_running_ends_the_wait_at_its_timeout(fakes):
    done = wait(fakes, [""], "1", kind="job")
    assert done.returncode == 124
    assert "job ray-course-train has not ended after 1s (last status: none)" in done.stderr
    assert wait(fakes, [""], kind="pod").returncode == 2


def test_every_kubectl_call_of_the_wait_has_a_request_timeout_and_the_namespace(fakes):
    wait(fakes, ["Failed "], "60", "team-a", reason="AppFailed", message="x")
    calls = [line.split("\x1f")[:-1] for line in (Path(fakes["FAKE_DIR"]) / "kubectl.log").read_text().splitlines()]
    assert len(calls) == 3
    for call in calls:
        assert call[:3] == ["get", "rayjob", "ray-course-train"]
        assert "--request-timeout=30s" in call and call[3:5] == ["--namespace", "team-a"]
