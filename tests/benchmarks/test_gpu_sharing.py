"""The shared-GPU service benchmark's own reading (``benchmarks.service.gpu_sharing``): trials at once from their spans,
and a rank's log line as ``workers.on_ray.gang.join`` writes it. (The runs themselves: benchmarks/gpu_checks.sh.)"""

from __future__ import annotations

from benchmarks.service.gpu_sharing import JOINED, gpu_name, overlap


def test_trials_at_once_is_the_most_spans_over_one_moment() -> None:
    assert overlap([(0, 2), (1, 3), (2.5, 4), (5, 6)]) == 2
    assert overlap([(0, 10), (1, 2), (1.5, 3), (1.8, 9)]) == 4
    assert overlap([(0, 1), (1, 2)]) == 1  # one ended as the other started
    assert overlap([]) == 0


def test_a_ranks_join_line_gives_its_backend_device_and_card() -> None:
    line = ("[tlab] rank 1 of 2 joined on gloo (cuda:0; resources.gpus_per_worker=0.5, "
            "CUDA_VISIBLE_DEVICES='3')")
    found = JOINED.search(line)
    assert found is not None and found.groups() == ("1", "gloo", "cuda:0", "'3'")
    assert gpu_name("cpu") == "cpu"
