"""helpers.tooling.bench: its timed loop, the FLOP counts it reports, its report.

Statistics: test_rounds; FLOP counts come from helpers.profiling; the start-up phases it reads, from
helpers.troubleshooting: tests/test_troubleshooting.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.profiling import training_flops_per_image
from helpers.rounds import compare, run_rounds, spread
from helpers.tooling import bench


def test_rounds_rotate_so_no_variant_always_runs_first():
    order = []
    variants = {name: (lambda name=name: order.append(name) or len(order)) for name in "xyz"}
    runs = run_rounds(variants, rounds=3)
    assert order == list("xyz" "yzx" "zxy")
    assert runs == {"x": [1, 6, 8], "y": [2, 4, 9], "z": [3, 5, 7]}
    order.clear()
    assert run_rounds(variants, rounds=1, warmup=True) == {"x": [2], "y": [3], "z": [4]}
    assert order == list("xxyz"), "the warm-up run of the first variant is dropped"


def _tiny_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))


@pytest.mark.parametrize(("bf16", "channels_last"), [(False, False), (True, False), (False, True), (True, True)])
def test_the_timed_loop_trains_in_the_asked_precision_and_layout(bf16, channels_last):
    torch.manual_seed(0)
    model = _tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    seen = []
    model[0].register_forward_hook(lambda module, inputs, output: seen.append((output.dtype, inputs[0])))
    batches = iter([(torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))) for _ in range(5)])
    images_per_s = bench.loop_images_per_s(model, batches, steps=3, warmup=2, device=torch.device("cpu"),
                                           bf16=bf16, channels_last=channels_last)
    assert images_per_s > 0
    assert len(seen) == 5, "warm-up and timed steps each run one forward pass"
    assert all(dtype == (torch.bfloat16 if bf16 else torch.float32) for dtype, _ in seen)
    assert all(x.is_contiguous(memory_format=torch.channels_last) == channels_last for _, x in seen)
    weights_format = torch.channels_last if channels_last else torch.contiguous_format
    assert model[0].weight.is_contiguous(memory_format=weights_format)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters())), "the optimizer stepped"


def test_training_flops_are_three_forward_passes_per_image():
    linear = nn.Linear(100, 10)
    assert training_flops_per_image(linear, (100,)) == 3 * 2 * 100 * 10
    conv = nn.Conv2d(3, 8, kernel_size=3)  # output 8 x 6 x 6, each output 3*3*3 multiply-adds
    assert training_flops_per_image(conv, (3, 8, 8)) == 3 * 2 * (8 * 6 * 6) * (3 * 3 * 3)


class SelfAttention(nn.Module):
    """The ViT's attention: nn.MultiheadAttention over (sequence, features) inputs, batch first."""

    def __init__(self, features: int, heads: int):
        super().__init__()
        self.attention = nn.MultiheadAttention(features, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, need_weights=False)[0]


def test_attention_counts_its_projections_and_both_products():
    # The Q, K, V projections (2 * L * E * 3E), Q @ K^T and weights @ V (2 * L * L * E each), the output projection
    # (2 * L * E * E). Counted in eval() without gradients, nn.MultiheadAttention takes a fused path that torch's
    # counter has no formula for: the ViT's attention counted 0, half its FLOPs.
    sequence, features = 4, 8
    forward = 2 * sequence * features * 3 * features + 2 * 2 * sequence * sequence * features \
        + 2 * sequence * features * features
    assert training_flops_per_image(SelfAttention(features, heads=2), (sequence, features)) == 3 * forward
    assert torch.backends.mha.get_fastpath_enabled(), "the fast path is back on afterwards"


def test_the_device_limits_are_measured():
    cpu = torch.device("cpu")
    assert 0 < bench.matmul_tflops(cpu, torch.float32, size=256, repeats=2) < 100
    assert 0 < bench.copy_gb_per_s(cpu, size_mb=8, repeats=2) < 10_000


def test_the_command_line_takes_parts_and_flags_in_any_order():
    args = bench.parse_args(["--json", "out.json", "data", "device", "--rounds", "3"])
    assert (args.parts, args.rounds, str(args.json)) == (["device", "data"], 3, "out.json")
    assert bench.parse_args(["--quick"]).parts == list(bench.PARTS)
    for bad in (["gpu"], ["--rounds", "0"], ["--num-workers", "1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_the_printed_table_gives_median_spread_and_verdict():
    runs = {"a": [110.0, 120.0, 130.0], "b": [100.0, 100.0, 100.0]}
    report = {"machine": {"cpu": "a CPU", "logical_cpus": 2, "gpu": None}, "rounds": 3,
              "ddp": {"images_per_s": {k: spread(v) for k, v in runs.items()},
                      "comparisons": [compare(runs, "a", "b")]}}
    table = bench.format_report(report)
    assert "a CPU (2 logical CPUs), GPU: none; 3 round(s)" in table
    assert "120.0 images/s [110.0-130.0]" in table
    assert "1.200x [1.100-1.300]: faster in every round" in table


def test_a_missing_recorded_report_says_how_to_make_it():
    with pytest.raises(FileNotFoundError, match="python -m helpers.tooling.bench --json"):
        bench.recorded_report("no-such-report")


def test_the_rest_of_a_fit_is_taken_run_by_run():
    fit = {"fit_s": {"rounds": [100.0, 90.0, 120.0]}, "epochs_s": {"rounds": [60.0, 70.0, 60.0]},
           "worker_group_total": {"rounds": [10.0, 10.0, 30.0]}}
    assert bench.rest_of_fit(fit) == 30.0  # the rests: 30, 10, 30
    fit["fit_s"]["rounds"] = [100.0, 120.0, 90.0]  # the rests: 30, 40, 0; the medians' difference is 100-60-10 = 30
    assert bench.rest_of_fit(fit) == 30.0
    fit["epochs_s"]["rounds"] = [80.0, 70.0, 60.0]  # the rests: 10, 40, 0; the medians' difference is 100-70-10 = 20
    assert bench.rest_of_fit(fit) == 10.0
