import numpy as np, jax, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
import structinfer as si
from scipy.stats import multivariate_normal as mvn
from scipy.special import logsumexp
rng=np.random.default_rng(0)
x=rng.normal(size=(30,2))
means=np.array([[0.,0.],[1.,0.],[1e3,1e3]]); covs=np.stack([np.eye(2)*0.5]*3)
st,info=si.infer.gmm_em(x,means,covs,max_iters=20,tol=0.0)
print("weights", np.asarray(st.weights), "ll", float(st.log_likelihood), "nonfinite", bool(info.nonfinite))
m,c,w=np.asarray(st.means),np.asarray(st.covariances),np.asarray(st.weights)
L=np.stack([np.log(w[k])+mvn(m[k],c[k]).logpdf(x) for k in range(2)],1); print("ref ll (2 live comps)", logsumexp(L,1).sum())
st32,info32=si.infer.gmm_em(x.astype(np.float32),means,covs,max_iters=20,tol=0.0)
print("f32 weights", np.asarray(st32.weights), "ll", float(st32.log_likelihood), "nonfinite", bool(info32.nonfinite))
