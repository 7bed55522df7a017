"""diagnostics.edge_agreement: true_edges outside [0, parents) are refused eagerly but under
jit give finite numbers: -1 wraps to the last parent (true_parent_prob reads it, finite and
wrong); an index == parents gives NaN true_parent_prob but a finite accuracy that silently
counts the child as wrong.  Rule: NaN under jit, never a finite wrong number.
Responsible: structinfer/diagnostics/edges.py edge_agreement (check only when concrete;
take_along_axis normalises negative indices)."""
import jax, jax.numpy as jnp
import structinfer as si
D = si.diagnostics
a = jnp.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
for t in ([0, -1], [0, 3]):
    t = jnp.array(t)
    try:
        D.edge_agreement(a, t)
    except ValueError as e:
        print("eager  true_edges", t.tolist(), "-> ValueError:", str(e)[:70])
    r = jax.jit(D.edge_agreement)(a, t)
    print("  jit  true_edges", t.tolist(), "-> accuracy", float(r.accuracy), "true_parent_prob",
          float(r.true_parent_prob), " (expected NaN, NaN)")
