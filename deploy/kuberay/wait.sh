#!/usr/bin/env bash
# Wait until a RayJob or a Job ends, and say how it ended:  deploy/kuberay/wait.sh rayjob|job NAME [TIMEOUT_S] [NAMESPACE]
# It reads the object's status every 10 s with kubectl (each call limited to 30 s) and prints each change.
# A RayJob (KubeRay v1.7.0's status.jobDeploymentStatus, with status.jobStatus, the Ray job's own status;
# ray-operator/apis/ray/v1/rayjob_types.go):
#   Complete          the operator is done: exit 0 if the Ray job SUCCEEDED, else 1 (STOPPED)
#   Failed            the operator gave up, a FAILED Ray job too (status.reason: AppFailed, SubmissionFailed,
#                     DeadlineExceeded, ...): exit 1
#   ValidationFailed  the operator refused the spec for good: delete the RayJob, fix it, apply it again: exit 1
#   Suspended         spec.suspend is true: nothing runs until you set it to false: exit 1
#   Initializing, Waiting, Running, Retrying, Suspending: on the way.
# A Job (Kubernetes' status.conditions that are True): Complete, exit 0; Failed or Suspended, exit 1.
# An end other than success prints status.reason and status.message (a Job's: those of its condition).
# An object that cannot be read 3 times in a row (deleted, no access): kubectl's error, exit 1.
# Arguments missing, or a kind other than rayjob or job: the usage, exit 2.
# Not ended after TIMEOUT_S seconds (default 7500): exit 124, with the last status.
set -u
usage="usage: wait.sh rayjob|job NAME [TIMEOUT_S] [NAMESPACE]"
[[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }
kind=$1
name=$2
timeout_s=${3:-7500}
namespace=${4:-}
poll_s=${WAIT_POLL_S:-10}
get() {
  kubectl get "$kind" "$name" ${namespace:+--namespace "$namespace"} --request-timeout=30s -o "jsonpath=$1"
}
case "$kind" in
  rayjob)
    status_path='{.status.jobDeploymentStatus} {.status.jobStatus}'
    why() { echo "reason: $(get '{.status.reason}') | message: $(get '{.status.message}')"; } ;;
  job)
    status_path='{range .status.conditions[?(@.status=="True")]}{.type} {end}'
    why() {
      local type
      for type in Failed Suspended; do
        [[ " $status " == *" $type "* ]] || continue
        echo "reason: $(get "{.status.conditions[?(@.type==\"$type\")].reason}") | message: $(get \
          "{.status.conditions[?(@.type==\"$type\")].message}")"
      done
    } ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
deadline=$((SECONDS + timeout_s))
last="(none)"
while :; do
  failures=0
  until status=$(get "$status_path" 2>&1); do  # a passing error (API server restart, network) is retried
    if ((++failures >= 3)); then
      echo "$kind $name cannot be read: $status" >&2
      exit 1
    fi
    sleep "$poll_s"
  done
  read -r -a words <<<"$status"
  status="${words[*]}"  # one space between words, none around them
  if [[ "$status" != "$last" ]]; then
    echo "${SECONDS}s: ${status:-(no status yet)}"
    last=$status
  fi
  if [[ "$kind" == rayjob ]]; then
    case "${words[0]:-}" in
      Complete) [[ "${words[1]:-}" == SUCCEEDED ]] && exit 0; why; exit 1 ;;
      Failed | ValidationFailed | Suspended) why; exit 1 ;;
    esac
  else
    case " $status " in
      *" Complete "*) exit 0 ;;
      *" Failed "* | *" Suspended "*) why; exit 1 ;;
    esac
  fi
  if ((SECONDS >= deadline)); then
    echo "$kind $name has not ended after ${timeout_s}s (last status: ${status:-none}): kubectl describe $kind $name" >&2
    exit 124
  fi
  sleep "$poll_s"
done
