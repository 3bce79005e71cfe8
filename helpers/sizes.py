"""The sizes that depend on the course's mode, in one place: `smoke` (COURSE_SMOKE_TEST=1, or a script's
--smoke-test: tiny runs that check everything works, as CI runs the lessons) and `full` (the lessons as recorded).
It imports nothing from the course. The modules that use a size keep their old names for it (`ingest.SMOKE_ROWS`,
`tuning.SEARCH_ROWS`, ...), which the lessons import; lesson cells pick between them themselves."""

from __future__ import annotations

from typing import Any

SIZES: dict[str, dict[str, Any]] = {
    "full": {
        #: MNIST rows per split that Ray Data's lessons (03-06) and their script read: all of them.
        "mnist_rows": None,
        #: CIFAR-10 rows per split (lesson 09, the capstone): all of them.
        "cifar_rows": None,
        #: Lesson 09's own run and job (train_capstone.py): epochs, and the rows of each split a CPU-only cluster trains
        #: and tests on, 3 epochs in minutes on 2 cores (with GPUs: all of them, `cifar_rows`).
        "capstone_run": {"epochs": 3, "cpu_rows": {"train": 2000, "test": 1000}},
        #: The tutorial's ViT (lesson 09).
        "vit": {"num_layers": 12, "num_heads": 8, "hidden_dim": 384, "mlp_dim": 768},
        #: The rows of MNIST every Tune trial trains and validates on (lesson 11, tune_ray_ddp.py): a cut, so that a
        #: search of 8 whole runs takes minutes on a laptop.
        "search_rows": {"train": 6000, "valid": 1000},
        #: tune_ray_ddp.py's search without flags: trials, and epochs per trial (ASHA may stop a trial earlier).
        "search": {"num_samples": 8, "epochs": 4},
        #: train_streaming.py's dataset in GB (GiB) without --data-size-gb.
        "streaming_gb": 1.0,
        #: train_ray_ddp.py's steps per epoch, and batches of 512 test images: all of them.
        "ddp_script_steps": None,
        "ddp_script_test_batches": None,
        #: Lesson 12's and train_fsdp.py's model: 8 blocks of 1024 features, 68M parameters (259 MiB in float32).
        "fsdp_model": {"width": 1024, "depth": 8},
        #: Lesson 12's optimizer steps per epoch in its measuring runs, and in its training run that must fit.
        "fsdp_steps": {"measure": 8, "train": 80},
        #: Lesson 12's memory budget per worker, in MiB: less than DDP's 16 bytes per parameter, more than FSDP2's on 2.
        "fsdp_budget_mb": 768,
    },
    "smoke": {
        "mnist_rows": {"train": 1920, "valid": 1000},  # 15 steps of 128 images, 1000 to validate
        "cifar_rows": {"train": 512, "test": 256},  # 4 steps of 128 images, 256 to test
        "capstone_run": {"epochs": 3, "cpu_rows": {"train": 512, "test": 256}},
        "vit": {"num_layers": 2, "num_heads": 4, "hidden_dim": 64, "mlp_dim": 128},  # the same structure, small
        "search_rows": {"train": 512, "valid": 256},
        "search": {"num_samples": 4, "epochs": 3},
        "streaming_gb": 0.01,
        "ddp_script_steps": 12,
        "ddp_script_test_batches": 2,  # 2 x 512 test images, else all 10,000
        "fsdp_model": {"width": 64, "depth": 2},
        "fsdp_steps": {"measure": 2, "train": 6},
        "fsdp_budget_mb": 2,
    },
}


def mode(smoke_test: bool) -> str:
    """The mode's key in SIZES."""
    return "smoke" if smoke_test else "full"


def sized(name: str, smoke_test: bool) -> Any:
    """The size `name` of SIZES in smoke mode (`smoke_test`) or in full mode."""
    return SIZES[mode(smoke_test)][name]
