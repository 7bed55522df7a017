import numpy as np, jax, jax.numpy as jnp, numpyro, warnings
jax.config.update("jax_enable_x64", True)
import structinfer as si
def dt(tree): return sorted({str(a.dtype) for a in jax.tree.leaves(tree) if hasattr(a,'dtype') and jnp.issubdtype(a.dtype, jnp.floating)})
rng=np.random.default_rng(0)
x=rng.normal(size=(20,2)).astype(np.float32)
st,info=si.infer.gmm_em(x, x[:2].astype(np.float64), np.stack([np.eye(2)]*2), max_iters=3); print("gmm f32:", dt(st), dt(info))
st,info=si.infer.linear_mixture_em(x[:-1], x[1:], np.stack([np.eye(2)]*2), np.zeros((2,2)), np.stack([np.eye(2)]*2), max_iters=3); print("lin f32:", dt(st), dt(info))
st,info=si.infer.markov_switching_em(x, np.stack([np.eye(2)]*2), np.zeros((2,2)), np.ones((2,2)), max_iters=3); print("ms f32:", dt(st), dt(info))
s=rng.normal(size=(5,5))
for d in (np.float32, jnp.bfloat16):
    st,info=si.infer.geometric_beta(jnp.asarray(s,d), 0.1, 0.9); print("geobeta", d, dt(st), dt(info), "attn sum", np.asarray(st.attention.astype(float).sum(-1)))
    st,info=si.infer.geometric_beta(jnp.asarray(s,d), 0.1, 0.9, method="plugin"); print("geobeta plugin", d, dt(st), dt(info))
X=jnp.asarray(rng.normal(size=(7,3)),jnp.float32)
def hop(X, mu):
    with numpyro.plate("q", mu.shape[0]):
        si.edge("m", si.priors.Uniform(X.shape[0]), si.scores.Dot(mu, X, scale=1.0))
st,info=si.infer.cccp(si.infer.model_log_z(hop,"mu",X), X[:2]); print("cccp f32:", dt(st), dt(info))
st,info=si.infer.gradient_descent(si.infer.model_energy(hop,"mu",X), X[:2], max_iters=5); print("gd f32:", dt(st), dt(info))
r=si.infer.laplace(hop,"mu",X[:2],X); print("laplace f32:", dt(r))
Xb=X.astype(jnp.bfloat16)
try:
    st,info=si.infer.cccp(si.infer.model_log_z(hop,"mu",Xb), Xb[:2], max_iters=5); print("cccp bf16:", dt(st), dt(info))
except Exception as e: print("cccp bf16:", type(e).__name__, str(e)[:150])
st,info=si.infer.slot_em(x, x[:2], np.eye(2), np.eye(2), max_iters=3); print("slot f32:", dt(st), dt(info))
