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


def test_frontier_figure_names_the_gold_and_gives_the_proxy_its_own_axis():
    """plots/frontier.png: x is frontier/sqrt_kl, the left axis the gold (named by
    frontier_gold_label: the verifier, or eval.frontier_gold's component), the right axis the
    proxy, each line holding exactly the logged values in step order."""
    from types import SimpleNamespace

    import matplotlib.pyplot as plt

    from rlhflab.config import config_from_dict
    from rlhflab.plots import frontier_figure, frontier_gold_label

    rows = [{"step": 0, "frontier/sqrt_kl": 0.0, "frontier/gold": 4.1, "frontier/proxy": 0.17},
            {"step": 5, "train/loss": 1.0},  # not a frontier row
            {"step": 10, "frontier/sqrt_kl": 0.5, "frontier/gold": 4.4, "frontier/proxy": 0.19},
            {"step": 20, "frontier/sqrt_kl": 1.2, "frontier/gold": 4.0, "frontier/proxy": 0.21}]  # fmt: skip
    raw = {"trainer": "policy_gradient", "model": {"name_or_path": "m"}}
    assert frontier_gold_label(config_from_dict(raw)) == "gold: verifier"
    raw["eval"] = {"frontier_gold": {"name": "judge", "args": {"path": "j"}}}
    label = frontier_gold_label(config_from_dict(raw))
    assert label == "gold: judge (eval.frontier_gold)"
    assert frontier_gold_label(SimpleNamespace(eval=SimpleNamespace())) == "gold: verifier"  # SFT
    fig = frontier_figure(rows, label)
    left, right = fig.axes
    (gold,), (proxy,) = left.get_lines(), right.get_lines()
    assert list(gold.get_xdata()) == list(proxy.get_xdata()) == [0.0, 0.5, 1.2]
    assert list(gold.get_ydata()) == [4.1, 4.4, 4.0]
    assert list(proxy.get_ydata()) == [0.17, 0.19, 0.21]
    assert gold.get_label() == label and left.get_ylabel().startswith(label)
    assert right.get_ylabel().startswith("proxy")
    # each axis spans its own line: the proxy is not drawn flat on the judge's 1-10 scale
    lo, hi = right.get_ylim()
    assert lo <= 0.17 and hi >= 0.21 and hi - lo < 0.1
    plt.close(fig)
    assert frontier_figure(rows[:2]) is None  # one point: no plot
