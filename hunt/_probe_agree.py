import numpy as np, jax, jax.numpy as jnp
import structinfer as si
D=si.diagnostics
a=jnp.array([[0.7,0.2,0.1],[0.1,0.1,0.8]])
for t in ([0,-1],[0,3],[0,2]):
    t=jnp.array(t)
    try: r=D.edge_agreement(a,t); print("eager", t, r.accuracy, r.true_parent_prob)
    except Exception as e: print("eager", t, type(e).__name__, str(e)[:80])
    r=jax.jit(D.edge_agreement)(a,t); print("  jit", t, float(r.accuracy), float(r.true_parent_prob))
