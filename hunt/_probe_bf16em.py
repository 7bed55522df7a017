import numpy as np, jax, jax.numpy as jnp
import structinfer as si
rng=np.random.default_rng(0)
x=np.concatenate([rng.normal(size=(20,2)), rng.normal(size=(15,2))+3])
m=x[[0,25]]; c=np.stack([np.eye(2)]*2)
st64,_=si.infer.gmm_em(x.astype(np.float32),m,c,max_iters=5,tol=0.0)
for name,f in (("gmm", lambda xb: si.infer.gmm_em(xb,m,c,max_iters=5,tol=0.0)),
               ("linmix", lambda xb: si.infer.linear_mixture_em(xb[:-1],xb[1:],np.stack([np.eye(2)]*2),np.zeros((2,2)),c,max_iters=3)),
               ("msem", lambda xb: si.infer.markov_switching_em(xb,np.stack([np.eye(2)]*2),np.zeros((2,2)),np.ones((2,2)),max_iters=3)),
               ("slot", lambda xb: si.infer.slot_em(xb,xb[[0,25]],np.eye(2),np.eye(2),max_iters=2))):
    try:
        st,info=f(jnp.asarray(x,jnp.bfloat16))
        print(name, "ok", {k: str(v.dtype) for k,v in st._asdict().items()}, "ll/energy", float(getattr(st,'log_likelihood',getattr(st,'energy',np.nan))))
    except Exception as e: print(name, type(e).__name__, str(e)[:160])
print("gmm f32 ll", float(st64.log_likelihood))
