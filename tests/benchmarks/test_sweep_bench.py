"""The sweep benchmark's pieces (its runs take minutes on a real stack: `python -m benchmarks.sweep_bench --quick`):
registration, and the specs and search space it submits are ones the service accepts."""

from __future__ import annotations

from api_schemas import build_spec
from api_schemas.sweeps import SweepSubmit
from benchmarks import run_all, sweep_bench


def test_registered_in_run_all() -> None:
    assert "sweep_bench" in run_all.ORDER and "sweep_bench" in run_all.discover()


def test_paper_spec_and_variants_validate() -> None:
    spec = sweep_bench.paper_mnist_spec(50, [1024, 1024])
    best = sweep_bench.with_config(spec, {"teleport.lr": 0.05, "teleport.cap": 10, "teleport.tau": 0.99})
    off = sweep_bench.with_config(spec, {"teleport.enabled": False})
    assert spec["teleport"]["lr"] == 0.2 and spec["teleport"]["enabled"] is True  # the copies left it alone
    assert build_spec(best).teleport.cap == 10 and build_spec(off).teleport.enabled is False
    default = build_spec(sweep_bench.with_config(spec, sweep_bench.PAPER_DEFAULT))
    assert (default.teleport.lr, default.teleport.cap, default.teleport.tau) == (0.2, 5.0, 1.0)
    assert default.training.target_loss == sweep_bench.TARGET and default.optimizer.lr == 2e-4


def test_the_search_it_submits_is_a_valid_sweep() -> None:
    sweep = SweepSubmit.model_validate({"base": sweep_bench.paper_mnist_spec(20, [1024, 1024]), "num_samples": 12,
                                        "scheduler": "asha", "search_space": sweep_bench.SEARCH_SPACE,
                                        "max_concurrent_trials": 2})
    assert sweep.report_metric == "final_train_loss"
