"""Plot keys: prefix patterns expand to every matching metric."""

from rlhflab.plots import _expand, plot_run


def test_expand_patterns_and_plot(tmp_path):
    rows = [
        {
            "step": 1,
            "rollout/reward_mean": 0.5,
            "rollout/reward/correctness_mean": 0.2,
            "rollout/reward/reward_model_mean": -1.0,
            "rollout/reward/reward_model_std": 0.3,
        },
        {
            "step": 2,
            "rollout/reward_mean": 0.7,
            "rollout/reward/correctness_mean": 0.1,
            "rollout/reward/reward_model_mean": 0.5,
            "rollout/reward/reward_model_std": 0.2,
        },
    ]
    keys = _expand(["rollout/reward_mean", "rollout/reward/*_mean"], rows)
    assert keys == [
        "rollout/reward_mean",
        "rollout/reward/correctness_mean",
        "rollout/reward/reward_model_mean",
    ]
    written = plot_run(rows, tmp_path)
    assert [p.name for p in written] == ["reward.png"]
