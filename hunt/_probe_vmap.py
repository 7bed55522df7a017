import numpy as np, jax, jax.numpy as jnp
import structinfer as si
rng=np.random.default_rng(0)
xs=np.stack([np.concatenate([rng.normal(size=(15,2)), rng.normal(size=(15,2))+s]) for s in (1.,4.,8.)]).astype(np.float32)
means=np.stack([x[[0,20]] for x in xs]); covs=np.broadcast_to(np.eye(2,dtype=np.float32),(3,2,2,2))
stv,infov=jax.vmap(lambda x,m,c: si.infer.gmm_em(x,m,c,max_iters=60))(xs,means,covs)
for i in range(3):
    st,info=si.infer.gmm_em(xs[i],means[i],covs[i],max_iters=60)
    print(i, int(info.num_steps), int(infov.num_steps[i]), float(st.log_likelihood), float(stv.log_likelihood[i]), np.abs(np.asarray(st.means)-np.asarray(stv.means[i])).max())
