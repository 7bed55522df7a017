import numpy as np, jax, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
import structinfer as si
from scipy.stats import multivariate_normal as mvn
rng=np.random.default_rng(0)
x=np.concatenate([rng.normal(size=(20,2)), rng.normal(size=(15,2))+3])
means=x[[0,25,5]]; covs=np.stack([np.eye(2)]*3); w=np.array([0.2,0.3,0.5])
def np_em(x,m,c,w,it):
    for _ in range(it):
        L=np.stack([np.log(w[k])+mvn(m[k],c[k]).logpdf(x) for k in range(len(w))],1)
        ll=np.logaddexp.reduce(L,1).sum(); r=np.exp(L-np.logaddexp.reduce(L,1,keepdims=True))
        nk=r.sum(0); w=nk/len(x); m=(r.T@x)/nk[:,None]
        c=np.stack([((r[:,k,None]*(x-m[k])).T@(x-m[k]))/nk[k] for k in range(len(w))])
    L=np.stack([np.log(w[k])+mvn(m[k],c[k]).logpdf(x) for k in range(len(w))],1)
    return m,c,w,np.logaddexp.reduce(L,1).sum()
st,info=si.infer.gmm_em(x,means,covs,w,max_iters=5,tol=0.0)
m,c,ww,ll=np_em(x,means,covs,w,5)
print("ll", float(st.log_likelihood), ll, int(info.num_steps))
print("means diff", np.abs(np.asarray(st.means)-m).max(), "w", np.asarray(st.weights), ww)
st32,_=si.infer.gmm_em(x.astype(np.float32),means,covs,w,max_iters=5,tol=0.0)
print("f32 dtypes", st32.means.dtype, st32.log_likelihood.dtype, st32.responsibilities.dtype, float(st32.log_likelihood))
stj,_=jax.jit(lambda x: si.infer.gmm_em(x,means,covs,w,max_iters=5,tol=0.0))(x)
print("jit ll", float(stj.log_likelihood))
