"""Pure tensor maths of post-training losses, one module per kind; each ends with its registry.

- `policy`: per-token policy-gradient surrogates (`POLICY_LOSSES`: PPO-clip and dual clip, GSPO,
  CISPO, SAPO, GMPO, Clip-Cov, KL-Cov, REINFORCE)
- `advantages`: group / batch / greedy baselines, REINFORCE++, OPO, GPG, pass@k, OTB and GAE
  (`ADVANTAGES`)
- `kl`: KL(π_θ ‖ π_ref) estimators k1, k2, k3, abs and straight-through variants (`KL_ESTIMATORS`)
- `aggregate`: per-token loss -> scalar with explicit per-step denominators (`AGGREGATIONS`)
- `value`: clipped value loss and explained variance for PPO's critic
- `correction`: training–inference mismatch: truncated importance sampling, mismatch stats,
  sequence-level / batch-normalised importance weights and rejection masks

These modules import only torch and the standard library, never read configs and never sync the
device (`.item()`).
"""
