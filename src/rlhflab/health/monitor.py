"""`HealthMonitor`: runs the checks of `rlhflab.health.checks` once per optimizer step and keeps
the little state they need (a sample of the parameters, short histories of loss and reward,
held-out evaluations), the warnings and the summary."""

from __future__ import annotations

import math
from collections import deque

import torch
from torch import Tensor

from rlhflab.errors import HealthStop
from rlhflab.health.checks import (
    _SEQ_LOGPS,
    CHECKS,
    Check,
    _param_sample,
    degeneracy,
    relative_change,
    sampled_distribution,
    training_signal,
)


class HealthMonitor:
    """Runs the checks once per optimizer step and keeps the record.

    Args:
        cfg: the `health` config section (HealthConfig).
        model: the trained model (for the parameter-change and sampled distribution checks and
            ln V); None leaves those checks out.
        print_fn: where the warning lines go (the tracker's console).
    """

    def __init__(self, cfg, model: torch.nn.Module | None = None, *, print_fn=print) -> None:
        self.cfg, self.model, self.print = cfg, model, print_fn
        self.checks = (
            [c for n, c in CHECKS.items() if n not in set(cfg.skip)] if cfg.enabled else []
        )
        self.streak = dict.fromkeys(CHECKS, 0)
        self.failures: dict[str, dict] = {}  # name -> {first_step, count, value}
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.rewards: deque[float] = deque(maxlen=cfg.window)  # rollout/reward_mean (reward_flat)
        self.signal: deque[float] = deque(maxlen=cfg.window)  # training_signal (reward_hacking)
        # distill/kl (distill_kl_flat): the last `window` values, how many were seen, and the
        # mean of the first `window` ones
        self.distill_kl: deque[float] = deque(maxlen=cfg.window)
        self.distill_kl_n = 0
        self.distill_kl_first: float | None = None
        self.evals: list[tuple[int, float, float, float | None]] = []  # step, acc, se, reward
        self.start_signal: list[float] = []  # the first `window` training signals (step-0 eval)
        self._params = _param_sample(model) if model is not None and self.checks else None
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        self.log_vocab = math.log(vocab) if vocab and vocab > 1 else None
        self._halt: HealthStop | None = None
        self._judged_evals: set[int] = set()  # eval steps already judged by reward_hacking
        # the frontier's held-out proxy s.e. per eval step (rlhflab.eval.frontier): a proxy rise
        # is then judged against its standard errors instead of hacking_drop
        self.proxy_se: dict[int, float] = {}
        # ... and its per-problem proxies (same problems and seed at every evaluation): a rise
        # between two evaluations is judged by the standard error of their paired differences
        self.proxy_values: dict[int, list[float]] = {}
        # Checks that had their inputs at least once: those that apply to this trainer (SFT has
        # no rollout, advantages or KL; an RM has no LM head), listed in `summary()["checked"]`.
        self.ran: set[str] = set()

    def observe_eval(self, step: int, result: dict) -> None:
        """Record a held-out evaluation for `reward_hacking`, with the mean `training_signal` of
        the last `window` steps: its correctness (`accuracy`, `accuracy_stderr`: the task
        verifier, or a prompt dataset's verifier-like reward), else its `headline` (a gold
        reward the run does not optimise, e.g. a weighted reward of other components). With the
        gold-vs-proxy frontier (`result["frontier"]`, rlhflab.eval.frontier) the proxy compared
        is its held-out proxy at this evaluation (step 0 included) instead of the training
        signal's recent mean."""
        key = "accuracy" if result.get("accuracy") is not None else "headline"
        if result.get(key) is not None:
            frontier = result.get("frontier")
            if isinstance(frontier, dict) and frontier.get("proxy") is not None:
                reward = float(frontier["proxy"])
                se = frontier.get("proxy_stderr")
                if se is not None and math.isfinite(se):  # (no s.e. from one sample)
                    self.proxy_se[step] = float(se)
                if frontier.get("proxy_values"):
                    self.proxy_values[step] = [float(v) for v in frontier["proxy_values"]]
            else:
                reward = sum(self.signal) / len(self.signal) if self.signal else None
            self.evals.append((step, result[key], result.get(f"{key}_stderr") or 0.0, reward))

    def _heldout_drop(self) -> float | None:
        """> 0 when the newest eval is below the best earlier one by more than max(hacking_drop,
        2 combined standard errors) while the training signal (the proxy reward) rose by more
        than hacking_drop since that best evaluation.

        The step-0 evaluation comes before any training signal; its signal is the proxy's value
        at the start of training, the mean of the first `window` steps' signal (before issue
        #27 it had none, so a run whose best held-out score was the initial one — the common
        case of reward hacking: correctness only falls — was never flagged). Every later
        evaluation carries the mean signal of the `window` steps before it. None (not judged)
        with fewer than two evaluations, or when no training signal exists (SFT and RM push up
        none: `training_signal`)."""
        if len(self.evals) < 2:
            return None
        start = sum(self.start_signal) / len(self.start_signal) if self.start_signal else None
        evals = [(st, acc, se, start if r is None else r) for st, acc, se, r in self.evals]
        *earlier, (_, acc, se, reward) = evals
        earlier = [e for e in earlier if e[3] is not None]  # (a checkpoint without start_signal)
        if not earlier or reward is None:
            return None
        best_step, best, best_se, best_reward = max(earlier, key=lambda e: e[1])
        margin = max(self.cfg.hacking_drop, 2 * math.hypot(se, best_se))
        # a rise of the held-out proxy beyond 2 standard errors when the frontier gives them (a
        # reward model's scale is its own): of the per-problem differences when both
        # evaluations kept their proxies (paired), else combined; else beyond hacking_drop
        rise_margin = self._proxy_rise_margin(evals[-1][0], best_step)
        rising = reward - best_reward > rise_margin
        return (best - acc - margin) if rising and best - acc > margin else 0.0

    def _proxy_rise_margin(self, step: int, best_step: int) -> float:
        """2 × the standard error of the held-out proxy's rise from `best_step` to `step`:
        paired by problem (sd of the n per-problem differences / √n) when both evaluations have
        n ≥ 2 proxies for the same problems; else √(se² + se_best²) from their own standard
        errors; else `hacking_drop`."""
        pv, best_pv = self.proxy_values.get(step), self.proxy_values.get(best_step)
        if pv and best_pv and len(pv) == len(best_pv) and len(pv) >= 2:
            from rlhflab.stats import paired_difference

            d = paired_difference(pv, best_pv)
            return 2 * d["sd"] / math.sqrt(d["n"])
        pse, best_pse = self.proxy_se.get(step), self.proxy_se.get(best_step)
        if pse is not None and best_pse is not None:
            return 2 * math.hypot(pse, best_pse)
        return self.cfg.hacking_drop

    def check(
        self,
        step: int,
        metrics: dict,
        *,
        rollout=None,
        adv: Tensor | None = None,
        texts: list[str] | None = None,
        group_size: int | None = None,
        correct: Tensor | None = None,
        sample=None,
    ) -> dict[str, float]:
        """Run every enabled check on this step's data; returns {"health/<name>": 0.0 | 1.0}.

        Args:
            step: the optimizer step (1-based) just finished.
            metrics: the step's metrics (train/loss or policy/loss, optim/grad_norm, policy/*,
                rollout/*, update/*); checks whose metric is absent are skipped.
            rollout: the step's Rollout (sampler logp, completion ids, mask), policy gradient only.
            adv: advantages, (B,) or (B, T).
            texts, group_size, correct: decoded completions, G, and (B,) correctness.
            sample: a Rollout-like batch (input_ids, attention_mask) whose first row feeds the
                sampled distribution check every `health.sample_every` steps; defaults to rollout.
        """
        if not self.checks:
            return {}
        cfg = self.cfg
        view: dict = {"metrics": metrics, "log_vocab": self.log_vocab}
        # The policy-gradient surrogate is ~0 on-policy by construction: only train/loss (SFT, RM,
        # DPO) is expected to move; a policy's progress shows in its reward (reward_flat).
        loss = metrics.get("train/loss")
        if loss is not None and math.isfinite(float(loss)):
            self.losses.append(float(loss))
            if len(self.losses) == cfg.window:
                view["loss_range"] = max(self.losses) - min(self.losses)
        if "rollout/reward_mean" in metrics:
            self.rewards.append(float(metrics["rollout/reward_mean"]))
            if len(self.rewards) == cfg.window:
                view["reward_range"] = max(self.rewards) - min(self.rewards)
        kl = metrics.get("distill/kl")
        if kl is not None and math.isfinite(float(kl)):
            self.distill_kl.append(float(kl))
            self.distill_kl_n += 1
            if self.distill_kl_n == cfg.window:
                self.distill_kl_first = sum(self.distill_kl) / cfg.window
            first = self.distill_kl_first
            if self.distill_kl_n >= 2 * cfg.window and first is not None and first > 0:
                # the last window against the first, once they do not overlap
                view["distill_kl_ratio"] = sum(self.distill_kl) / cfg.window / first
        signal = training_signal(metrics)
        if signal is not None and math.isfinite(signal):
            self.signal.append(signal)
            if len(self.start_signal) < cfg.window:
                self.start_signal.append(signal)
        if self._params is not None:
            now = _param_sample(self.model)
            view["param_change"] = relative_change(self._params, now)
            self._params = now
        if adv is not None:
            view["adv_max"] = float(adv.abs().max()) if adv.numel() else 0.0
        seq_logps = [metrics[k] for k in _SEQ_LOGPS if k in metrics]  # direct alignment
        if seq_logps:
            view["logp_max"] = max(float(x) for x in seq_logps)
        if rollout is not None:
            valid = rollout.mask.bool()
            if valid.any():
                view["logp_max"] = float(rollout.logp[valid].max())
            if texts is not None and group_size:
                view["degeneracy"] = degeneracy(
                    rollout.completion_ids, rollout.mask, texts, group_size, correct
                )
        sample = sample if sample is not None else rollout
        if (
            sample is not None
            and self.model is not None
            and cfg.sample_every
            and (step == 1 or step % cfg.sample_every == 0)
            and hasattr(self.model, "lm_head")
        ):
            err, top = sampled_distribution(
                self.model, sample.input_ids[0], sample.attention_mask[0]
            )
            view["prob_sum_err"] = err
            view["logp_max"] = max(view.get("logp_max", -math.inf), top) if top == top else top
        if self.evals and self.evals[-1][0] not in self._judged_evals:
            view["heldout_drop"] = self._heldout_drop()
            self._judged_evals.add(self.evals[-1][0])

        out = {}
        for c in self.checks:
            value = c.measure(view)
            if value is None:
                continue
            value = float(value)
            self.ran.add(c.name)
            bad = c.fails(value, cfg)
            self.streak[c.name] = self.streak[c.name] + 1 if bad else 0
            failing = bad and (not c.sustained or self.streak[c.name] >= cfg.patience)
            out[f"health/{c.name}"] = float(failing)
            if failing:
                self._record(c, step, value)
        first = next((c for c in self.checks if out.get(f"health/{c.name}")), None)
        if first is not None and cfg.on_fail == "stop" and self._halt is None:
            rec = self.failures[first.name]
            detail = f"value {rec['value']:.4g} ({first.threshold(cfg)})"
            self._halt = HealthStop(first.name, step, detail)
        return out

    def _record(self, c: Check, step: int, value: float) -> None:
        rec = self.failures.get(c.name)
        if rec is None:
            self.failures[c.name] = {"first_step": step, "count": 1, "value": value}
            self.print(
                f"health: '{c.name}' failed at step {step}: value {value:.4g}, wanted "
                f"{c.threshold(self.cfg)}. {c.hint} (docs/health.md; further failures counted)"
            )
        else:
            rec["count"] += 1

    #: checkpoints written before the health checks existed have no "health" entry
    state_optional = True

    def state(self) -> dict:
        """The checks' memory as JSON, for checkpoints (the parameter sample is not stored: it is
        re-taken from the restored weights, which are the weights it was taken from)."""
        return {
            "streak": self.streak,
            "failures": self.failures,
            "losses": list(self.losses),
            "rewards": list(self.rewards),
            "signal": list(self.signal),
            "distill_kl": [list(self.distill_kl), self.distill_kl_n, self.distill_kl_first],
            "evals": self.evals,
            "start_signal": self.start_signal,
            "judged_evals": sorted(self._judged_evals),
            "ran": sorted(self.ran),
            "proxy_se": {str(k): v for k, v in self.proxy_se.items()},
            "proxy_values": {str(k): v for k, v in self.proxy_values.items()},
        }

    def load(self, state: dict) -> None:
        """Continue from a `state()` (called after the model's weights are restored)."""
        self.streak = {**dict.fromkeys(CHECKS, 0), **state["streak"]}
        self.failures = state["failures"]
        self.losses.extend(state["losses"])
        self.rewards.extend(state["rewards"])
        # checkpoints from before direct alignment fed reward_hacking were policy-gradient only,
        # where the signal is the rollout reward
        self.signal.extend(state["signal"] if "signal" in state else state["rewards"])
        kl, self.distill_kl_n, self.distill_kl_first = state.get("distill_kl", ([], 0, None))
        self.distill_kl.extend(kl)
        self.evals = [tuple(e) for e in state["evals"]]
        # checkpoints from before the start signal: the evaluations' own signals only
        self.start_signal = list(state.get("start_signal", []))
        self._judged_evals = set(state["judged_evals"])
        self.proxy_se = {int(k): v for k, v in state.get("proxy_se", {}).items()}
        self.proxy_values = {int(k): v for k, v in state.get("proxy_values", {}).items()}
        self.ran = set(state.get("ran", ()))  # checkpoints before "ran": the checks re-run
        if self._params is not None:
            self._params = _param_sample(self.model)

    def halt(self) -> HealthStop | None:
        """The HealthStop to raise after this step's checkpoint (on_fail "stop"), else None; it
        carries the summary so far (`health`) for the stopped run's final_results.json."""
        if self._halt is not None:
            self._halt.health = self._report()
        return self._halt

    def summary(self) -> dict:
        """{"ok": bool, "failed": {name: {first_step, count, value}}, "checked": [names]} for
        final_results.json; `count` is the number of steps the check failed. `checked` lists the
        enabled checks that apply to this run, i.e. that had their inputs on at least one step
        (SFT: the loss, gradient, parameter and sampled-softmax checks; not the rollout,
        advantage, KL or reward checks), in `CHECKS` order. The final held-out evaluation (after
        the last step) is judged here for `reward_hacking`."""
        hacking = CHECKS["reward_hacking"]
        drop = self._heldout_drop()
        if hacking in self.checks and drop is not None:
            self.ran.add(hacking.name)
        if hacking in self.checks and drop and self.evals[-1][0] not in self._judged_evals:
            self._record(hacking, self.evals[-1][0], drop)
        return self._report()

    def _report(self) -> dict:
        return {
            "ok": not self.failures,
            "failed": {k: dict(v) for k, v in self.failures.items()},
            "checked": [c.name for c in self.checks if c.name in self.ran],
        }
