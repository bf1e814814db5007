"""The PRIME advantage as a naive loop, shared by tests/losses/test_prime.py and
tests/trainers/test_pg_prime.py."""

import torch

F64 = torch.float64


def naive_prime_rloo(r, mask, outcome, G, gamma):
    """The paper's equation, one (i, t) at a time."""
    B, T = r.shape
    adv = torch.zeros(B, T, dtype=F64)
    lengths = [int(mask[i].sum()) for i in range(B)]
    mean = [
        sum(float(r[i, t]) for t in range(T) if mask[i, t]) / max(lengths[i], 1) for i in range(B)
    ]
    for i in range(B):
        g0 = (i // G) * G
        others = [j for j in range(g0, g0 + G) if j != i]
        b = sum(mean[j] for j in others) / (G - 1)
        o = float(outcome[i]) - sum(float(outcome[j]) for j in others) / (G - 1)
        for t in range(T):
            if not mask[i, t]:
                continue
            ret, k = 0.0, 0
            for s in range(t, T):
                if mask[i, s]:
                    ret += gamma**k * (float(r[i, s]) - b)
                    k += 1
            adv[i, t] = ret + o
    return adv
