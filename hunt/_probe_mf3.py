import numpy as np, jax, jax.numpy as jnp
import structinfer as si
rng=np.random.default_rng(5)
s=jnp.asarray(rng.normal(size=(3,6,6))*3, jnp.float32)
a0=jnp.asarray(rng.uniform(0.05,2,size=(3,6)),jnp.float32)
st,info=si.infer.geometric_beta(s,a0,0.9,max_iters=200)
worst=0
for b in range(3):
    st1,info1=si.infer.geometric_beta(s[b],a0[b],0.9,max_iters=200)
    worst=max(worst, float(jnp.abs(st1.attention-st.attention[b]).max()))
    for i in range(6):
        r=si.diagnostics.convergence_report(np.asarray(info.energy[b,i])[:int(info.num_steps[b,i])+1], tol=1e-6)
        if not r.monotone: print("non-monotone", b, i, r)
print("batched vs single max diff", worst)
