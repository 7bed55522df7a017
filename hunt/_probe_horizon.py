import numpy as np, jax, jax.numpy as jnp
import structinfer as si
s=jnp.zeros((4,4))
for a0,b0,meth in ((1e-9,1.0,"plugin"),(0.1,1e10,"exact"),(0.1,0.9,"exact")):
    st,info=si.infer.geometric_beta(s,a0,b0,method=meth,max_iters=1)
    print(meth,a0,b0,"window",np.asarray(st.window),"mean_q",np.asarray(st.mean_q),"H(q) float",np.asarray(si.infer.horizon(st.mean_q)))
    st0=si.infer.mean_field.init(s,a0,b0,method=meth); print("   init window", np.asarray(st0.window), "H float", np.asarray(si.infer.horizon(st0.mean_q)))
