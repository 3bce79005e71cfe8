"""Lesson 08's commands for a real cluster, run here against a fake `kubectl` (and fake `ray`, `helm`, `docker`,
`openssl`) on PATH: the RayJob wait ends on every state KubeRay can report, with the reason, or at its timeout; every
command the lesson prints carries a time limit; the token never appears in any command's arguments."""

from __future__ import annotations

import json
import os
import re
import shlex
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
  [[ -e "$FAKE_DIR/flaky" ]] && { rm "$FAKE_DIR/flaky"; echo "Unable to connect to the server: EOF" >&2; exit 1; }
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


def test_one_passing_kubectl_error_does_not_end_the_wait(fakes):
    (Path(fakes["FAKE_DIR"]) / "flaky").touch()  # the first call fails, as when the API server restarts
    done = wait(fakes, ["Running RUNNING", "Complete SUCCEEDED"])
    assert done.returncode == 0 and "cannot be read" not in done.stderr


def test_wait_s_usage_errors_have_their_documented_codes(fakes):
    assert subprocess.run([str(WAIT), "rayjob"], env=fakes, capture_output=True, timeout=60).returncode == 2
    done = subprocess.run([str(WAIT), "pod", "x"], env=fakes, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage: wait.sh" in done.stderr


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


LESSON = REPO_ROOT / "notebooks" / "08_kuberay.ipynb"


@pytest.fixture
def lesson_commands(monkeypatch) -> list[tuple[str, float]]:
    """Every command lesson 08 runs on a cluster, with its time limit: the cells that call on_cluster, run with a
    recorder in its place."""
    recorded: list[tuple[str, float]] = []
    monkeypatch.setattr(kuberay, "on_cluster", lambda command, timeout=900: recorded.append((command, timeout)))
    namespace = {"kuberay": kuberay}
    for cell in json.loads(LESSON.read_text())["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and "on_cluster(" in source:
            exec(source, namespace)  # the lesson's own cells
    assert len(recorded) >= 15
    return recorded


def _simple_commands(command: str) -> list[list[str]]:
    """The simple commands of a shell command line, each as its words without leading VAR=value assignments; a
    command substitution `$(...)` counts as a command of its own (and as one word where it stands)."""
    commands = []
    while (start := command.find("$(")) >= 0:
        end = command.index(")", start)
        commands += _simple_commands(command[start + 2:end])
        command = command[:start] + "SUBSTITUTED" + command[end + 1:]
    command = re.sub(r"\d*>&\d+", " ", command)  # 2>&1: a redirection, not a `&`
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    current: list[str] = []
    for token in [*lexer, ";"]:
        if token in (";", "&", "&&", "|", "||"):
            while current and re.fullmatch(r"[A-Za-z_]\w*=.*", current[0]):
                current.pop(0)
            if current:
                commands.append(current)
            current = []
        else:
            current.append(token)
    return commands


#: Programs that end by themselves at once (or are bounded by the command around them).
QUICK = {"openssl", "tr", "base64", "grep", "echo", "sleep", "kill", "rm", "cat", "awk", "sed", "test", "date"}


def _time_limit_problem(words: list[str], timeout: float) -> str | None:
    program, args = words[0], words[1:]
    if program == "kubectl":
        verb = args[0]
        flag = {"wait": "--timeout=", "port-forward": "--pod-running-timeout=", "config": None}.get(
            verb, "--request-timeout=")
        if flag and not any(arg.startswith(flag) for arg in args):
            return f"kubectl {verb} without {flag}"
    elif program == "helm":
        if args[0] in ("install", "upgrade") and "--timeout" not in args:
            return "helm install without --timeout"
    elif program == "ray":
        entrypoint = args[args.index("--") + 1:] if "--" in args else []
        if args[:2] == ["job", "submit"] and entrypoint[:1] != ["timeout"]:
            return "ray job submit whose entrypoint has no `timeout`"
    elif program == "deploy/kuberay/wait.sh":
        if len(args) < 3 or not args[2].isdigit() or timeout <= int(args[2]):
            return "wait.sh without its TIMEOUT_S, or with on_cluster's timeout below it"
    elif program == "docker":  # on the learner's machine, not the cluster: bounded only by on_cluster's timeout
        if timeout == 900 or args[0] not in ("build", "buildx", "push"):
            return "docker without an explicit on_cluster timeout"
    elif program not in QUICK:
        return f"{program}: not a command this test knows"
    return None


def test_every_command_of_the_lesson_has_a_time_limit(lesson_commands):
    problems = [f"{problem}: {command}" for command, timeout in lesson_commands
                for words in _simple_commands(command)
                if (problem := _time_limit_problem(words, timeout))]
    assert problems == []


def test_the_time_limit_check_catches_the_commands_it_is_for():
    assert _time_limit_problem(["kubectl", "get", "pods"], 900) == "kubectl get without --request-timeout="
    assert _time_limit_problem(["kubectl", "wait", "raycluster/x", "--for=condition=HeadPodReady"], 900)
    assert _time_limit_problem(["helm", "install", "x", "y", "--wait"], 900)
    assert _time_limit_problem(["ray", "job", "submit", "--", "python", "train.py"], 900)
    assert _time_limit_problem(["deploy/kuberay/wait.sh", "rayjob", "x"], 900)
    assert _time_limit_problem(["curl", "http://x"], 900)
    line = "A=1 RAY_AUTH_TOKEN=$(kubectl get secret s -o jsonpath='{.data.x}' | base64 -d) ray job submit -- x && ls"
    assert _simple_commands(line) == [["kubectl", "get", "secret", "s", "-o", "jsonpath={.data.x}"], ["base64", "-d"],
                                      ["ray", "job", "submit", "--", "x"], ["ls"]]


def _argv_with_token(command: str, fakes: dict[str, str]) -> list[list[str]]:
    """Run `command` with bash -x against the fakes; every command line (argv) bash ran that holds the token."""
    done = subprocess.run(["bash", "-xc", command], env=fakes, capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    found = []
    for line in done.stderr.splitlines():
        if not line.startswith("+"):
            continue
        words = shlex.split(line.lstrip("+ "))
        while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):  # an assignment: the environment, not argv
            words.pop(0)
        if any(TOKEN in word for word in words):
            found.append(words)
    for log in ("kubectl.log", "commands.log"):  # what the programs themselves received
        path = Path(fakes["FAKE_DIR"]) / log
        for line in path.read_text().splitlines() if path.exists() else []:
            if TOKEN in line:
                found.append(line.split("\x1f"))
    return found


def test_the_lesson_never_puts_the_token_on_a_command_line(lesson_commands, fakes):
    token_commands = [command for command, _ in lesson_commands if "secret" in command and "delete" not in command]
    assert len(token_commands) == 2  # the Secret for Helm, and the token for `ray job submit`
    for command in token_commands:
        assert _argv_with_token(command, fakes) == [], command
    # The Secret got the token, through the pipe (no newline); `ray` got it in its environment.
    assert (Path(fakes["FAKE_DIR"]) / "stdin").read_text() == TOKEN
    assert (Path(fakes["FAKE_DIR"]) / "ray-env.log").read_text().splitlines()[-1] == TOKEN


def test_the_token_check_catches_a_token_on_a_command_line(fakes):
    # What the lesson did before: the token in kubectl's arguments, where `ps` shows it to every user of the machine.
    literal = 'kubectl create secret generic ray-course-auth --from-literal=auth_token="$(openssl rand -hex 32)"'
    assert _argv_with_token(literal, fakes) != []
    exported = "ray job submit --env-json '{\"RAY_AUTH_TOKEN\": \"'$(openssl rand -hex 32)'\"}' -- true"
    assert _argv_with_token(exported, fakes) != []


def test_every_step_says_what_healthy_looks_like():
    # Each cell of section 09 that runs commands on the cluster follows prose saying what "healthy" looks like;
    # building the image (Docker, not the cluster) and cleaning up are not checks.
    cells = json.loads(LESSON.read_text())["cells"]
    prose = ""
    steps = []
    for cell in cells:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            prose = source
        elif "on_cluster(" in source and "docker build" not in source and "kubectl delete" not in source:
            steps.append(("Healthy" in prose, source.splitlines()[-1]))
    assert len(steps) == 7  # with the egress policy's addresses
    assert [source for healthy, source in steps if not healthy] == []
