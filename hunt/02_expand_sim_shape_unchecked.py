"""si.infer.expand: a sim_fn returning (K_max, 1) instead of (K_max,) is not refused;
`jnp.where(act, sim, -inf)` broadcasts to (K_max, K_max) and the log-sum-exp then runs
over every (k, l) pair, *including inactive placeholder parents' similarities*:
a finite wrong energy and wrong expansion decisions, no error.
Responsible: structinfer/infer/expansion.py body() (`sim = jnp.where(act, sim_fn(child, par), -inf)`),
no check of sim_fn's output shape."""
import jax, jax.numpy as jnp, numpy as np
import structinfer as si

parents = jnp.array([[0.0, 0.0], [5.0, 5.0], [0.1, 0.1], [0.0, 0.0]])  # rows 2,3: placeholders
active = jnp.array([True, True, False, False])
children = jnp.array([[0.05, 0.05], [3.0, 3.0]])

good = lambda c, z: -0.5 * jnp.sum((z - c) ** 2, -1)                 # (K_max,)
bad = lambda c, z: -0.5 * jnp.sum((z - c) ** 2, -1, keepdims=True)   # (K_max, 1)

r_good = si.infer.expand(children, parents, active, good, tau=2.0)
r_bad = si.infer.expand(children, parents, active, bad, tau=2.0)
ref = [float(-jax.nn.logsumexp(good(c, parents[:2]))) for c in children]
print("reference energies (active parents only):", np.round(ref, 4))
print("sim_fn -> (K,)  :", np.asarray(r_good.energies).round(4), "added", np.asarray(r_good.added))
print("sim_fn -> (K,1) :", np.asarray(r_bad.energies).round(4), "added", np.asarray(r_bad.added),
      "  <- finite wrong energies / decisions, no error")
