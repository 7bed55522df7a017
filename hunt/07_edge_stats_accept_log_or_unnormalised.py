"""diagnostics edge statistics take any (..., children, parents) array: log-marginals
(a prior's log_table, log-softmax output) or unnormalised rows are not refused, and
expected_distance / distance_posterior / edge_agreement.true_parent_prob return finite
wrong numbers (entropy gives -inf, effective_window NaN, so they are inconsistent).
Responsible: structinfer/diagnostics/_common.py check_marginals (checks ndim only).
Fix: when concrete, refuse negative entries and rows whose sum is not 1 (dtype-aware
tolerance), naming the argument; under jit make such rows NaN."""
import numpy as np, jax, jax.numpy as jnp
import structinfer as si
D = si.diagnostics
prior = si.priors.Geometric(0.4, 5)
logp = prior.log_table(5)                       # log-probabilities, as the prior hands them out
logp = jnp.where(jnp.isfinite(logp), logp, -30.0)  # e.g. a masked log-softmax
p = jnp.exp(logp)
print("expected_distance(probabilities) :", np.asarray(D.expected_distance(p)).round(3))
print("expected_distance(log-probs)     :", np.asarray(D.expected_distance(logp)).round(3), " <- finite, wrong, no error")
print("distance_posterior(log-probs)    :", np.asarray(D.distance_posterior(logp)[1]).round(2), " <- 'probabilities' < 0, no error")
print("edge_agreement(2*probs).true_parent_prob:", float(D.edge_agreement(2 * p, jnp.zeros(5, int)).true_parent_prob),
      "(rows sum to 2; no error) vs normalised:", float(D.edge_agreement(p, jnp.zeros(5, int)).true_parent_prob))
print("edge_entropy(log-probs)          :", np.asarray(D.edge_entropy(logp)))
