"""Plain-loop references for the PDDM score (Eq. 2) and the joint loss (Eqs. 3, 4), Huang et al. 2016.

Written straight from the equations with explicit loops over pairs and samples; torch is used only for
float64 arithmetic on single vectors and for autograd, so the reference gradient can be compared too.
The choices documented on ``training.losses.pddm.PDDMLoss`` (min-max scaling over the whole batch graph,
squared distances, per-batch dropout masks) are spelled out here as loops.
"""

from __future__ import annotations

import torch


def _unit(x: torch.Tensor) -> torch.Tensor:
    """r(x) = x / |x|_2; a zero vector (all ReLUs off) stays zero, as with F.normalize."""
    return x / torch.clamp(x.norm(), min=1e-12)


def _relu(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x, min=0.0)


def pddm_score_reference(
    fi: torch.Tensor, fj: torch.Tensor, params: dict[str, torch.Tensor], masks: torch.Tensor | None = None
) -> torch.Tensor:
    """Eq. 2 for one pair of feature vectors (d,), with the unit's parameters by name."""
    fi, fj = _unit(fi), _unit(fj)
    u = (fi - fj).abs()
    v = (fi + fj) / 2
    hu = _relu(params["fc_u.weight"] @ u + params["fc_u.bias"])
    hv = _relu(params["fc_v.weight"] @ v + params["fc_v.bias"])
    if masks is not None:
        hu, hv = hu * masks[0], hv * masks[1]
    c = _relu(params["fc_c.weight"] @ torch.cat((_unit(hu), _unit(hv))) + params["fc_c.bias"])
    if masks is not None:
        c = c * masks[2]
    return (params["fc_s.weight"] @ c + params["fc_s.bias"])[0]


def pddm_loss_reference(
    embeddings: torch.Tensor,
    labels: list[int],
    params: dict[str, torch.Tensor],
    alpha: float,
    beta: float,
    lam: float,
    quadruplets: str,
    masks: torch.Tensor | None = None,
) -> torch.Tensor:
    """E_m + lambda E_e (Eqs. 3, 4), averaged over the mined quadruplets; 0 when there is none."""
    n = len(labels)
    scores: dict[tuple[int, int], torch.Tensor] = {}
    for i in range(n):
        for j in range(i + 1, n):
            scores[i, j] = scores[j, i] = pddm_score_reference(embeddings[i], embeddings[j], params, masks)

    # The batch similarity graph: every pair i < j; its least and most similar pair scale S into [0, 1].
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    if not pairs:
        return embeddings.sum() * 0.0
    low = min(pairs, key=lambda p: scores[p].item())
    high = max(pairs, key=lambda p: scores[p].item())
    scale = torch.clamp(scores[high] - scores[low], min=1e-12)

    def scaled(i: int, j: int) -> torch.Tensor:
        return (scores[i, j] - scores[low]) / scale

    def squared_distance(i: int, j: int) -> torch.Tensor:
        return ((_unit(embeddings[i]) - _unit(embeddings[j])) ** 2).sum()

    # Where (i^, j^) is searched: the whole batch, each class, or each sample as i^.
    groups = {
        "batch": [list(range(n))],
        "per_class": [[i for i in range(n) if labels[i] == c] for c in sorted(set(labels))],
        "per_sample": [[i] for i in range(n)],
    }[quadruplets]
    terms = []
    for group in groups:
        hardest = None  # (i^, j^) = argmin over positive pairs of S_ij
        for i in group:
            for j in range(n):
                if (
                    j != i
                    and labels[j] == labels[i]
                    and (hardest is None or scores[i, j].item() < scores[hardest].item())
                ):
                    hardest = (i, j)
        if hardest is None:
            continue
        i_hat, j_hat = hardest

        def most_similar_negative(a: int) -> int | None:
            best = None
            for b in range(n):
                if labels[b] != labels[a] and (best is None or scores[a, b].item() > scores[a, best].item()):
                    best = b
            return best

        k_hat, l_hat = most_similar_negative(i_hat), most_similar_negative(j_hat)
        if k_hat is None or l_hat is None:
            continue
        s_ij = scaled(i_hat, j_hat)
        e_m = _relu(alpha + scaled(i_hat, k_hat) - s_ij) + _relu(alpha + scaled(j_hat, l_hat) - s_ij)
        d_ij = squared_distance(i_hat, j_hat)
        e_e = _relu(beta + d_ij - squared_distance(i_hat, k_hat)) + _relu(
            beta + d_ij - squared_distance(j_hat, l_hat)
        )
        terms.append(e_m + lam * e_e)
    if not terms:
        return embeddings.sum() * 0.0
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total / len(terms)
