"""Exercise checks that need a running Ray: the wrong answer the exercise targets must give "not yet" within seconds,
not hang. (A module of its own: test_exercise_checks.py is of the fast tier, and a module holds one tier.)"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.state import list_workers

from helpers.session import start_task_workers
from tests.support import failed, run_check_cell

pytestmark = pytest.mark.ray


@ray.remote(num_cpus=1)
class TrainWorker:  # lesson 00's
    def placement_group_id(self) -> str:
        return ray.get_runtime_context().get_placement_group_id()


@ray.remote
def nap_began(seconds: float) -> float:  # lesson 00's nap, saying when it began
    began = time.time()
    time.sleep(seconds)
    return began


def end_idle_task_workers() -> int:
    """End the idle task worker processes of this Ray's node, this machine, as Ray ends one idle for over 1 s while
    its node has more idle workers than free CPUs; return how many. (An actor's process is named after its class.)"""
    node_id = ray.get_runtime_context().get_node_id()
    ours = {worker["pid"] for worker in list_workers(limit=10_000, raise_on_missing_output=False)
            if worker["worker_type"] == "WORKER" and worker["is_alive"] and worker["node_id"] == node_id}
    idle = [process for process in psutil.process_iter(["pid", "name"])
            if process.info["pid"] in ours and process.info["name"] == "ray::IDLE"]
    for process in idle:
        process.kill()
    psutil.wait_procs(idle, timeout=10)
    return len(idle)


def test_lesson_00_exercise_1_s_naps_start_at_once_after_start_task_workers(course_ray):
    """Exercise 1 times a 3 s nap against seven short ones on the second CPU: its check fails if the short ones wait
    for a worker process to start (seconds on a busy machine). `start_task_workers` starts them before the clock."""
    num_cpus = int(ray.cluster_resources()["CPU"])
    ray.get([nap_began.remote(0.5) for _ in range(num_cpus)])  # a task worker per CPU...
    assert end_idle_task_workers() >= 1  # ...ended, as Ray ends idle ones
    assert start_task_workers(num_cpus) == num_cpus
    submitted = time.time()
    began = ray.get([nap_began.remote(0.5) for _ in range(num_cpus)])
    assert max(began) - submitted < 0.5, f"a nap began {max(began) - submitted:.2f} s after it was submitted"


def test_lesson_00_exercise_3_says_not_yet_when_the_workers_start_outside_the_group(course_ray, capsys):
    """The typical mistake: TrainWorker.remote() without the bundle's scheduling strategy. While the group holds every
    CPU the workers never start, so `ray.get` on their answers would wait forever: the check waits 10 s at most."""
    num_bundles = int(ray.cluster_resources()["CPU"])  # the group holds every CPU, as num_bundles does on 2 CPUs
    workers_pg = placement_group([{"CPU": 1}] * num_bundles, strategy="PACK")
    ray.get(workers_pg.ready(), timeout=30)  # else actors on warm processes may start before the group reserves CPUs
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


# ---- 01 · exercise 3: torch's thread count set from the task's CPUs, also in a reused worker ---------------------

def torch_threads_unsolved() -> int:
    import torch

    return torch.get_num_threads()  # the stub: whatever the process's torch already had


def torch_threads_solved() -> int:
    import torch

    torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources()["CPU"])))
    return torch.get_num_threads()


def test_lesson_01_exercise_3_fails_on_the_stub_whatever_the_node_s_size_and_passes_once_solved(course_ray, capsys):
    """On a 1-CPU node the stub's fresh tasks happen to give 1 thread for 1 CPU: the first expectation can pass
    unsolved there. The second runs the answer where torch already has more threads, and fails on any node. As in
    the notebook, the solution then redefines `torch_threads` and calls the same check again: it must see the new
    function (a remote function made once would keep the stub it was first pickled with)."""
    import torch

    from helpers.exercises import check

    namespace = {"ray": ray, "torch": torch, "torch_threads": torch_threads_unsolved, "cpu_counts": [1],
                 "threads_by_cpus": {1: 1}}  # what the learner's cell gives on a 1-CPU node, solved or not
    results = run_check_cell("01_single_gpu_pytorch.ipynb", "exercise_3", namespace, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == [
        "also in a worker an earlier, larger task left with more threads"], results
    namespace["torch_threads"] = torch_threads_solved  # the solution cell's definition
    check("3", namespace["exercise_3"], strict=True)  # raises ExerciseNotPassed if the stub is still used


# ---- 03 · exercise 3: every shard of a streaming_split must ask before a pass starts: bounded, not a hang ---------

@ray.remote
def count_rows(shard) -> int:  # lesson 03's solution
    return sum(len(batch["label"]) for batch in shard.iter_batches(batch_size=None))


@pytest.mark.parametrize("mistake,wrong", [
    (None, []),
    ("a streaming_split per task", [
        "each shard holds valid_rows // 3 rows (the remainder is dropped), counted within 15 s"]),
])
def test_lesson_03_exercise_3_says_not_yet_within_its_wait_when_a_shard_never_asks(course_ray, capsys, mistake,
                                                                                   wrong):
    """With a split per task, each task's shard waits for two others of its split that never ask, and `ray.get`
    alone would wait forever: the check waits 15 s at most."""
    valid = ray.data.from_items([{"label": i} for i in range(100)]).materialize()
    if mistake:
        splits = [valid.streaming_split(3, equal=True) for _ in range(3)]
        count_refs = [count_rows.remote(splits[i][i]) for i in range(3)]
    else:
        count_refs = [count_rows.remote(shard) for shard in valid.streaming_split(3, equal=True)]
    started = time.perf_counter()
    try:
        results = run_check_cell("03_ray_data_ingest.ipynb", "exercise_3",
                                 {"ray": ray, "datasets": {"valid": valid}, "count_refs": count_refs}, capsys)
    finally:
        elapsed_s = time.perf_counter() - started
        if mistake:  # each task's split waits for its other two shards: read them here, at once, and the tasks end
            others = [split[j] for i, split in enumerate(splits) for j in range(3) if j != i]
            with ThreadPoolExecutor(max_workers=len(others)) as pool:
                list(pool.map(lambda shard: sum(1 for _ in shard.iter_batches(batch_size=None)), others))
        # Not ray.cancel(force=True): in Ray 2.60 a forced cancel can race the task's reply and abort this process
        # ("Check failed: ... Tried to complete task that was not pending", task_manager.cc), which ended a suite run.
        ray.get(count_refs, timeout=120)
    assert [what.split(" (AssertionError")[0] for what in failed(results)] == wrong, results
    if wrong:
        assert "no counts within 15 s" in failed(results)[-1], results
    assert elapsed_s < 25, f"the check took {elapsed_s:.1f} s"


# ---- 03 · exercises 1 and 2: a random flip per image, in Ray Data, applied anew on every pass ----------------------

def flip_solved(batch):  # lesson 03's solution
    import numpy as np

    images = batch["image"]
    flip = np.random.default_rng().random(len(images)) < 0.5
    batch["image"] = np.where(flip[:, None, None, None], images[..., ::-1], images)
    return batch


def flip_every_image(batch):
    batch["image"] = batch["image"][..., ::-1].copy()
    return batch


def flip_upside_down(batch):  # the wrong axis: rows, not columns
    import numpy as np

    images = batch["image"]
    flip = np.random.default_rng().random(len(images)) < 0.5
    batch["image"] = np.where(flip[:, None, None, None], images[..., ::-1, :], images)
    return batch


def flip_whole_batch(batch):  # one coin for the batch: all flipped or none
    import numpy as np

    if np.random.default_rng().random() < 0.5:
        batch["image"] = batch["image"][..., ::-1].copy()
    return batch


@pytest.fixture(scope="module")
def images_dataset(course_ray):
    """300 random images of lesson 03's shape: no image is its own mirror image."""
    import numpy as np

    images = np.random.default_rng(0).random((300, 1, 28, 28), dtype=np.float32)
    return ray.data.from_items([{"image": image, "label": i % 10} for i, image in enumerate(images)]).materialize()


@pytest.mark.parametrize("answer,wrong", [
    (flip_solved, []),
    (flip_every_image, ["some images are flipped, some are not"]),
    (flip_upside_down, ["each image is itself or its mirror image"]),
    (flip_whole_batch, ["some images are flipped, some are not"]),
])
def test_lesson_03_exercise_1_fails_on_a_flip_of_every_image_the_wrong_axis_or_one_coin_per_batch(
        images_dataset, capsys, answer, wrong):
    import numpy as np

    results = run_check_cell("03_ray_data_ingest.ipynb", "exercise_1",
                             {"np": np, "datasets": {"train": images_dataset}, "random_flip": answer}, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results


@pytest.mark.parametrize("mistake,wrong", [
    (None, []),
    ("augmented materialized", ["two passes over augmented flip different images"]),  # one set of flips, forever
    ("frozen without the flip", ["frozen holds flipped images"]),  # the plain dataset, materialized
])
def test_lesson_03_exercise_2_fails_when_the_augmented_dataset_is_materialized(images_dataset, capsys, mistake, wrong):
    import numpy as np

    augmented = images_dataset.map_batches(flip_solved)
    frozen = augmented.materialize()
    if mistake == "augmented materialized":
        augmented = frozen
    elif mistake == "frozen without the flip":
        frozen = images_dataset.materialize()
    results = run_check_cell("03_ray_data_ingest.ipynb", "exercise_2",
                             {"np": np, "datasets": {"train": images_dataset}, "augmented": augmented,
                              "frozen": frozen}, capsys)
    assert [what.split(" (")[0] for what in failed(results)] == wrong, results
