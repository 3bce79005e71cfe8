"""The nbval filter in the root conftest.py drops Ray's forwarded log lines, and nothing else."""

from __future__ import annotations

import nbformat
from conftest import drop_ray_log_lines


def _stream(name: str, text: str):
    return nbformat.from_dict({"output_type": "stream", "name": name, "text": text})


def test_lines_forwarded_by_ray_are_dropped_and_empty_streams_go():
    forwarded = (
        "\x1b[36m(TrainController pid=8566)\x1b[0m Requesting resources: {'CPU': 1.0} * 2\n"
        "\x1b[36m(pid=gcs_server)\x1b[0m [2026-11-22 06:46:53,887 E 6758 6758] Failed to kill actor\n"
        "(RayTrainWorker pid=42, ip=10.0.0.2) Moving model to device: cuda:0\n"
        "(Ray deduplicates logs by default. Set RAY_DEDUP_LOGS=0 to disable log deduplication.)\n"
        "[2026-11-22 13:06:00,208 E 12379 12379] core_worker.cc:2465: Actor with class name: 'MapWorker'\n"
    )
    result = nbformat.from_dict({"output_type": "execute_result", "data": {"text/plain": "1"}, "metadata": {}})
    assert drop_ray_log_lines([_stream("stderr", forwarded), result]) == [result]


def test_the_kernels_own_output_is_kept():
    warning = "/x/y.py:3: RayDeprecationWarning: `ExecutionOptions.exclude_resources` is deprecated\n"
    mixed = _stream("stderr", "\x1b[36m(DatasetManager pid=7)\x1b[0m a log line\n" + warning)
    kept = drop_ray_log_lines([mixed, _stream("stdout", "(a parenthesis, pid=3 is not a Ray prefix)\n")])
    assert [output["text"] for output in kept] == [warning, "(a parenthesis, pid=3 is not a Ray prefix)\n"]
