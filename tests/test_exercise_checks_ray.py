"""Exercise checks that need a running Ray: the wrong answer the exercise targets must give "not yet" within seconds,
not hang. (A module of its own: test_exercise_checks.py is of the fast tier, and a module holds one tier.)"""

from __future__ import annotations

import time

import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from tests.test_exercise_checks import failed, run_check_cell

pytestmark = pytest.mark.ray


@ray.remote(num_cpus=1)
class TrainWorker:  # lesson 00's
    def placement_group_id(self) -> str:
        return ray.get_runtime_context().get_placement_group_id()


def test_lesson_00_exercise_3_says_not_yet_when_the_workers_start_outside_the_group(course_ray, capsys):
    """The typical mistake: TrainWorker.remote() without the bundle's scheduling strategy. While the group holds every
    CPU the workers never start, so `ray.get` on their answers would wait forever: the check waits 10 s at most."""
    num_bundles = int(ray.cluster_resources()["CPU"])  # the group holds every CPU, as num_bundles does on 2 CPUs
    workers_pg = placement_group([{"CPU": 1}] * num_bundles, strategy="PACK")
    workers = [TrainWorker.remote() for _ in range(num_bundles)]  # no scheduling_strategy: outside the group
    id_refs = [worker.placement_group_id.remote() for worker in workers]
    namespace = {"ray": ray, "num_bundles": num_bundles, "workers_pg": workers_pg, "id_refs": id_refs,
                 "remove_placement_group": remove_placement_group}
    started = time.perf_counter()
    try:
        results = run_check_cell("00_ray_core.ipynb", "exercise_3", namespace, capsys)
    finally:
        for worker in workers:
            ray.kill(worker)
    elapsed_s = time.perf_counter() - started
    wrong = [what.split(" (")[0] for what in failed(results)]
    assert wrong == ["every worker answered within 10 s, from inside workers_pg"], results
    assert "GetTimeoutError" in failed(results)[0], results
    assert elapsed_s < 15, f"the check took {elapsed_s:.1f} s"
    assert placement_group_table(workers_pg)["state"] == "REMOVED", "the check cell removes the group"
