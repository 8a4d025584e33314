"""Smoke tests: each benchmark runs end to end on tiny sizes and writes well-formed results.

No assertion here looks at a wall-time ratio: timings on a shared 2-core machine are not a test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import convergence, fig5_scaling, float32_drift, run_all, step_cost


def _load(path: Path) -> dict:
    body = json.loads(path.read_text())
    assert {"benchmark", "machine"} <= body.keys()
    assert {"torch", "torch_threads", "cpu_count", "platform", "date"} <= body["machine"].keys()
    return body


def test_fig5_scaling_quick(results: Path) -> None:
    threads = torch.get_num_threads()
    fig5_scaling.main(["--quick", "--threads", "1"])
    assert torch.get_num_threads() == threads  # the benchmark gives the thread count back
    body = _load(results / "fig5_scaling.json")
    assert body["benchmark"] == "fig5_scaling" and body["quick"] is True
    assert body["machine"]["torch_threads"] == 1  # the threads it ran with
    assert {"base", "sweeps", "rows", "slopes", "floors", "notes"} <= body.keys()
    assert set(body["rows"]) == {"t", "d", "n", "l", "b"}
    for factor, rows in body["rows"].items():
        assert [r[factor] for r in rows] == body["sweeps"][factor]
        for r in rows:
            for method in ("symmetry", "nullspace"):
                assert r[method]["seconds"] > 0
                assert r[method]["steps_per_batch"] == [r["t"]] * r["b"]
            assert r["ratio"] > 0
        assert set(body["slopes"][factor]) == {"symmetry", "nullspace"}
    assert {f["floor"].split(" in ")[-1] for f in body["floors"] if "linearly" in f["floor"]} == {"t", "l", "b"}


def test_fig5_scaling_one_factor_goes_to_its_own_file(results: Path) -> None:
    fig5_scaling.main(["--quick", "--threads", "1", "--factors", "d"])
    assert not (results / "fig5_scaling.json").exists()  # the full sweep's results are not overwritten
    body = _load(results / "fig5_scaling_d.json")
    assert set(body["rows"]) == {"d"} and [r["d"] for r in body["rows"]["d"]] == body["sweeps"]["d"]


def test_convergence_reports_the_wall_clock_floors(results: Path) -> None:
    body = convergence.main(["--quick"])
    assert {"sgd_epochs_third", "sgd_teleport_share_10pct", "sgd_share_to_target_15pct",
            "sgd_seconds_to_target_below_baseline"} == set(body["floors"])
    assert all(isinstance(v, bool) for v in body["floors"].values())
    assert _load(results / "convergence.json")["quick"] is True


def test_convergence_puts_clipped_rows_beside_the_unclipped_in_a_file_of_their_own(results: Path) -> None:
    body = convergence.main(["--quick", "--clips", "0.5"])
    assert set(body["table"]) == {"sgd", "sgd, clip 0.5"} and not (results / "convergence.json").exists()
    assert body["cases"]["sgd, clip 0.5"]["spec"]["training"]["grad_clip_norm"] == 0.5
    assert _load(results / "convergence_clip.json")["table"].keys() == body["table"].keys()


def test_convergence_puts_scale_free_rows_beside_the_papers_with_one_baseline(results: Path) -> None:
    body = convergence.main(["--quick", "--scale-free"])
    assert set(body["table"]) == {"sgd", "sgd, scale-free"} and not (results / "convergence.json").exists()
    paper, free = body["runs"]["sgd"], body["runs"]["sgd, scale-free"]
    assert paper["baseline"] == free["baseline"]  # one baseline run for both rows
    assert body["cases"]["sgd, scale-free"]["spec"]["teleport"] | convergence.SCALE_FREE == \
        body["cases"]["sgd, scale-free"]["spec"]["teleport"]
    assert all(r["teleport_batches"] > 0 for r in free["teleport"])
    assert _load(results / "convergence_scale_free.json")["table"].keys() == body["table"].keys()


def test_step_cost_quick(results: Path) -> None:
    step_cost.main(["--quick", "--threads", "1"])
    body = _load(results / "step_cost.json")
    assert body["benchmark"] == "step_cost" and body["quick"] is True
    assert set(body["models"]) == {"mlp", "cnn", "transformer"}
    for r in body["models"].values():
        assert r["steps"] == body["steps"]
        for key in ("fwd_bwd_seconds", "overhead_seconds", "amortized_step_seconds", "ratio_amortized_step"):
            assert r[key] > 0
        assert r["step_excl_bases_seconds"] >= 0
        assert {"fwd_bwd", "fwd_bwd_math_sdpa", "teleport_0", "teleport_t"} == set(r["seconds"])
    assert len(body["floors"]) == 3


def test_float32_drift_quick(results: Path) -> None:
    float32_drift.main(["--quick"])
    body = _load(results / "float32_drift.json")
    assert body["benchmark"] == "float32_drift" and body["quick"] is True and body["seeds"] == 1
    assert set(body["rows"]) == {"mlp/numerical_rank", "mlp/energy", "cnn/numerical_rank", "cnn/energy"}
    for key, r in body["rows"].items():
        assert key.split("/")[1] == r["tau_rule"] and r["teleports"] == 2 and len(r["per_seed"]) == 1
        assert r["tries"] == r["steps"] + r["backoffs"] and 0 <= r["backoff_rate"] <= 1
        assert r["accepted"] == 0 or 0 <= r["drift_median"] <= r["drift_max"]
        assert r["free_per_layer"] and all(0 <= v["free_min"] <= v["free_max"] <= v["input_dim"]
                                           for v in r["free_per_layer"].values())
    assert [f["pass"] for f in body["floors"]] == [f["value"] is not None and f["value"] < body["floor"]
                                                   for f in body["floors"]]


def test_run_all_skips_missing(results: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert {"fig5_scaling", "step_cost", "float32_drift"} <= set(run_all.discover())
    assert run_all.main(["--quick", "--only", "no_such_benchmark"]) == 0
    assert "skipped: benchmarks/no_such_benchmark.py does not exist" in capsys.readouterr().out


def test_lm_payoff_quick(results: Path) -> None:
    from benchmarks import lm_payoff

    lm_payoff.main(["--quick", "--threads", "1"])
    body = _load(results / "lm_payoff.json")
    cost, pay = body["cost"], body["payoff"]
    assert body["device"] == "cpu" and set(cost["by_ascent"]) == {"host", "device"}
    for ascent, c in cost["by_ascent"].items():  # side by side: the host guard and the device ticks
        assert c["ran_as"] == ascent and c["forced_steps_taken"] == 8
        assert c["forced_drift"] < 1e-3 * 6  # the loss on the teleport batch stays (float32, ln 256 ≈ 5.5)
        assert c["host_reads_per_step"] == 1.0  # a count, not a time: one host read per ascent step
        assert c["launches_per_step"] > 0 and c["launches_per_teleport_setup"] > 0
    diff = cost["hvp_difference"]  # teleport.hvp: difference, beside the exact double backward, in both ascents
    assert set(diff["by_ascent"]) == {"host", "device"}
    for ascent, c in diff["by_ascent"].items():
        assert c["ran_as"] == ascent and c["forced_steps_taken"] == 8 and c["host_reads_per_step"] == 1.0
        assert c["launches_per_step"] < cost["by_ascent"][ascent]["launches_per_step"]  # no double backward
    assert 1 - diff["direction_cosine"] < 1e-3  # float32: ~2e-5 on the GPT-style LM (measured)
    assert cost["default_ascent"] == "host" and body["ascent"] == "auto"  # what auto runs on the CPU
    assert 0 < cost["scale_free_steps_taken"] < 8 and cost["scale_free_stop_reason"] == "cap"  # a teleport that moves
    assert 1.5 < cost["scale_free_gain"] <= 2.0 and cost["teleport_scale_free_in_train_steps"] > 0
    assert cost["launches_per_step"] == cost["by_ascent"]["host"]["launches_per_step"]
    assert set(pay) == {"sgd", "adam", "adam_first", "adamw_recipe", "adam_lr2", "adamw_recipe_lr2",
                        "adam_scale_free", "sgd_scale_free", "adamw_recipe_scale_free"}
    for row, base in (("adam_first", "adam"), ("adam_lr2", "adam"), ("adamw_recipe_lr2", "adamw_recipe"),
                      ("adam_scale_free", "adam"), ("sgd_scale_free", "sgd"),
                      ("adamw_recipe_scale_free", "adamw_recipe")):
        assert pay[row]["baseline_final_train_loss"] == pay[base]["baseline_final_train_loss"]  # one baseline
    for p in pay.values():
        assert p["baseline_final_train_loss"] > 0 and 0 <= p["teleport_share"] < 1
        assert [r["seed"] for r in p["seeds"]] == [0] and 0 <= p["reached"] <= 1  # --quick: one seed
        assert p["median_seconds_ratio"] == p["seconds_ratio"]
        assert set(p["ascents"]) == {"host"} and p["graph_replays"] == 0  # what auto's batches ran as on the CPU
    assert (body["ascent"], body["hvp"], body["ascent_asked"], body["hvp_asked"]) == ("auto", "exact", "auto", "exact")
    assert set(body["floors"]) == {"one_teleport_default_le_floor", "one_teleport_scale_free_le_floor",
                                   "host_reads_per_step_le_1",
                                   "adam_seconds_ratio_le_1", "adam_lr2_seconds_ratio_le_1",
                                   "adam_scale_free_seconds_ratio_le_1",
                                   "launches_per_step_le_fifth"}
    assert body["floors"]["launches_per_step_le_fifth"] is None  # a CUDA floor
    setup = cost["setup_phases"]  # a batch's setup: on the CPU no host eigh beside the device's (one route)
    assert set(setup["seconds"]) == {"evaluation", "plain_gradient", "recorded_forward", "bases", "bases_next_batch",
                                     "certificate_device", "eigvalsh_device", "eigh_device", "eigh_device_unproven",
                                     "eigh_host_pooled", "eigh_host_one_thread"}
    assert 0 < setup["proven_full_rank"] <= setup["representations"]
    assert all(v > 0 for v in setup["seconds"].values())
    assert sum(b[0] for b in setup["gram_batches"]) == setup["representations"] > 0  # every R's Gram, batched
    assert all(b[1] == b[2] for b in setup["gram_batches"])


def test_the_payoff_runs_the_hvp_the_cost_part_found_cheaper() -> None:
    from benchmarks.lm_payoff import cheaper_hvp, fastest_way

    cost = {"by_ascent": {"host": {"teleport_8_steps_s": 2.0}, "device": {"teleport_8_steps_s": 1.0}},
            "hvp_difference": {"by_ascent": {"host": {"teleport_8_steps_s": 1.5}, "device": {"error": "..."}}}}
    assert cheaper_hvp(cost, "host") == "difference"
    assert cheaper_hvp(cost, "device") == "exact"  # a row that failed is never the cheaper
    assert fastest_way(cost) == ("device", "exact")  # every ascent and HVP measured
    cost["hvp_difference"]["by_ascent"]["host"]["teleport_8_steps_s"] = 2.0
    assert cheaper_hvp(cost, "host") == "exact"  # a tie: the paper's
    cost["hvp_difference"]["by_ascent"]["cuda_graph"] = {"teleport_8_steps_s": 0.5}
    assert fastest_way(cost) == ("cuda_graph", "difference")


def test_lm_payoff_cuda_graph_rows_run_on_the_cpu_as_the_device_ticks() -> None:
    # what gpu_checks.sh asks of a GPU (new batches, the moving teleport), run here where a bug costs no device time
    from benchmarks.lm_payoff import teleport_cost

    cost = teleport_cost(torch.device("cpu"), True, 1, ascents=("cuda_graph",))
    for rows in (cost["by_ascent"], cost["hvp_difference"]["by_ascent"]):
        row = rows["cuda_graph"]
        assert "error" not in row and row["ran_as"] == "device"  # no CUDA: the ticks, uncaptured
        assert row["teleport_8_steps_new_batch_in_train_steps"] > 0 and row["scale_free_new_batch_in_train_steps"] > 0
        assert row["scale_free_steps"] >= 1 and row["scale_free_graph_replayed"] is False


def test_lm_payoff_runs_its_payoff_the_fastest_way_it_measured(results: Path) -> None:
    from benchmarks import lm_payoff

    lm_payoff.main(["--quick", "--threads", "1", "--ascent", "fastest"])
    body = _load(results / "lm_payoff.json")
    assert (body["ascent"], body["hvp"]) == lm_payoff.fastest_way(body["cost"])
    assert body["ascent"] in ("host", "device") and body["ascent_asked"] == "fastest"  # no CUDA graph on the CPU


def test_lm_trained_quick(results: Path) -> None:
    from benchmarks import lm_trained

    lm_trained.main(["--quick", "--threads", "2"])  # two threads: the eigh has two routes to choose between
    body = _load(results / "lm_trained.json")
    cost = body["cost"]
    assert cost["train_loss"]["last"] < cost["train_loss"]["first"]  # it trained
    setup = cost["setup_phases"]
    assert setup["proven_full_rank"] < setup["representations"]  # a trained LM's R need the eigh (2 of 9 proven)
    assert sum(b[0] for b in setup["unproven_gram_batches"]) == setup["representations"] - setup["proven_full_rank"]
    assert set(cost["by_route"]) == {"device", "host", "chosen"}
    for row in cost["by_route"].values():  # the same teleport by either route: it moves the LM, the loss stays
        assert row["steps"] >= 1 and 1.5 < row["gain"] <= 2.0 and row["drift"] < 1e-3 * 6
        assert row["ascent"] == "host" and row["in_train_steps"] > 0
        assert "backoffs" in row  # the learned aim: 0 on most warm batches (test_aim proves it)
    by_ascent = cost["by_ascent"]  # the same teleport by the host guard and the device ticks: the same step
    assert set(by_ascent) == {"host", "device"} and [r["ascent"] for r in by_ascent.values()] == ["host", "device"]
    assert all(r["steps"] >= 1 and r["drift"] < 1e-3 * 6 for r in by_ascent.values())
    emu = cost["emulated_graph"]  # the CUDA graph's path, the capture emulated: what a replayed batch would launch
    assert emu["eager_kernels"] > 0 and emu["captures"] >= 1 and emu["steps"] >= 1
    assert emu["graph_kernels"] > 0 or not emu["graph_replayed"]  # this tiny LM's rank, on the gram route, varies
    turns = cost["in_turn"]  # the aim learned: fewer back-offs over the batches in turn than the first order's
    assert set(turns) == {"first_order", "learned"} and turns["learned"]["backoffs"] < turns["first_order"]["backoffs"]
    assert all(1.0 < r["gain"] <= 2.0 for t in turns.values() for r in t["batches"])
    chosen = cost["eigh_route_chosen"].values()
    assert chosen and all(c["route"] in ("device", "host") and set(c["seconds"]) == {"device", "host"} for c in chosen)
    assert set(body["floors"]) == {"one_teleport_trained_le_floor"}


def test_adam_schedule_quick(results: Path) -> None:
    from benchmarks import adam_schedule

    adam_schedule.main(["--quick"])
    body = _load(results / "adam_schedule.json")
    assert set(body["rows"]) == {"baseline", "paper: epochs 0-4", "epoch 0 only", "scale-free: epochs 0-4",
                                 "scale-free: epoch 0 only"}
    assert body["rows"]["baseline"]["teleport_seconds"] == 0
    assert all(r["teleport_seconds"] > 0 for name, r in body["rows"].items() if name != "baseline")
    assert "adam_lt_1x" in body["floors"]
