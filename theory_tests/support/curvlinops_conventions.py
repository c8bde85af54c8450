"""Convention map, written as code: curvlinops-for-pytorch 3.0.1's ``KFACLinearOperator`` factors
-> ours (``torch_impl.kfac_factors``), for the peer test ``theory_tests/peers/test_curvlinops.py``.

Every difference between the two, and where it is handled:

* **bias joint or separate.** curvlinops' default ``separate_weight_and_bias=True`` keeps a
  bias its own block, ``G`` alone, and the weight's ``kron(G, A_w)`` with ``A_w`` of the inputs
  without a 1; ours always appends the bias column (A's last row and column, A[-1, -1] = 1).
  :func:`ours_as_curvlinops` cuts ours to the separate form (``A[:-1, :-1]``); joint, the two
  A's are the same matrix.
* **how the scalars are split between A and G.** Both: A = mean over the N S rows (expand) or
  over the N samples' means (reduce), G = R x the sums of the columns' g gᵀ. The factors are
  compared as they are (no rescaling), so a change of split on either side fails the test.
* **MSELoss(reduction="mean").** curvlinops divides by the data points in its G correction
  and multiplies its MC and empirical losses by sqrt(C) to make up for torch's division by the
  C outputs too; ours takes R = 1/numel directly. Same factors: no map.
* **the Monte-Carlo draws.** curvlinops draws from ``torch.Generator(device)`` seeded with
  ``seed`` (default 2147483647) at every ``compute_kronecker_factors``: for each of the M
  samples in turn, one ``multinomial(softmax, 1)`` over the (data points, C) rows (CE) or one
  ``randn`` of the output's shape (MSE, ỹ = f + sqrt(1/2) ε). Ours draws in the same order
  from the generator it is given: :func:`same_draws` gives it one seeded alike. (A different
  draw order would make MC comparable only in distribution.)
* **outputs of more than 2 dimensions.** curvlinops rearranges a CE output (N, C, d...) to
  ((N d...), C) and an MSE output (N, ..., C) to ((N ...), C): the data points in row-major
  order, as ours walk them. Same factors: no map.
* **what is refused.** curvlinops also takes ``BCEWithLogitsLoss`` and ``fisher_type=
  "forward-only"``: ours refuses both (``check_loss`` / ``check_flavour``), so they are not
  compared. Its hook backend is wrong for a weight used twice in one forward (tied weights);
  ours counts each call's rows: the peer test's weight sharing is over tokens of one call.
"""
import torch

__all__ = ["CURVLINOPS_SEED", "curvlinops_factors", "ours_as_curvlinops", "same_draws"]

#: KFACLinearOperator's default ``seed`` for the MC draws
CURVLINOPS_SEED = 2147483647


def same_draws(seed=CURVLINOPS_SEED):
    """A generator that draws what curvlinops' draws for ``seed`` (module docstring)."""
    return torch.Generator().manual_seed(seed)


def curvlinops_factors(model, loss_func, x, y, *, fisher_type, kfac_approx, joint_bias,
                       mc_samples=1):
    """{module name: (A or None, G)} from curvlinops' ``KFACLinearOperator`` on one batch."""
    from curvlinops import KFACLinearOperator
    params = [p for p in model.parameters() if p.requires_grad]
    op = KFACLinearOperator(model, loss_func, params, [(x, y)], fisher_type=fisher_type,
                            kfac_approx=kfac_approx, mc_samples=mc_samples,
                            separate_weight_and_bias=not joint_bias,
                            check_deterministic=False)
    op.compute_kronecker_factors()
    return {name: (op._input_covariances.get(name), op._gradient_covariances[name])
            for name in op._gradient_covariances}


def ours_as_curvlinops(A, G, has_bias, joint_bias):
    """Our (A, G) in curvlinops' form: the bias column cut from A when curvlinops keeps the
    bias separate (module docstring)."""
    if has_bias and not joint_bias:
        return A[:-1, :-1], G
    return A, G
