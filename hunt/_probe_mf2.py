import numpy as np, jax, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
import structinfer as si
from scipy.special import digamma, betaln, logsumexp
rng=np.random.default_rng(3)
n,m=5,8
s=rng.normal(size=(n,m))*2
a0,b0=0.3,1.7
def np_exact(s,inc,off,maxd,iters=300):
    d=np.arange(n)[:,None]+off-np.arange(m)[None,:]; d0=0 if inc else 1
    allowed=d>=d0
    if maxd is not None: allowed&=d<=maxd
    k=np.where(allowed,d-d0,0)
    out=[]
    for i in range(n):
        a,b=a0+1,b0
        for _ in range(iters):
            lg=np.where(allowed[i], s[i]+k[i]*(digamma(b)-digamma(a+b)), -np.inf); r=np.exp(lg-logsumexp(lg))
            b=b0+(r*k[i]).sum()
        out.append((r,b))
    return out
def np_plugin(s,inc,off,maxd,iters,mass=0.95):
    d=np.arange(n)[:,None]+off-np.arange(m)[None,:]; d0=0 if inc else 1
    allowed=d>=d0
    if maxd is not None: allowed&=d<=maxd
    k=np.where(allowed,d-d0,0); out=[]
    for i in range(n):
        a,b=a0,b0
        for t in range(iters+1):
            q=a/(a+b); H=max(np.ceil(np.log(1-mass)/np.log(1-q)),1)
            lg=np.where(allowed[i]&(k[i]<H), s[i]+k[i]*np.log1p(-q), -np.inf); r=np.exp(lg-logsumexp(lg))
            if t==iters: break
            a,b=a+1,b+(r*k[i]).sum()
        out.append((r,a,b,H))
    return out
for inc,off,maxd in [(True,0,None),(False,3,None),(True,3,4),(False,2,2)]:
    st,info=si.infer.geometric_beta(s,a0,b0,method="exact",include_self=inc,offset=off,max_distance=maxd,tol=1e-13,max_iters=500)
    ref=np_exact(s,inc,off,maxd)
    print("exact",inc,off,maxd,"attn diff",max(np.abs(np.asarray(st.attention[i])-ref[i][0]).max() for i in range(n)),"beta diff",max(abs(float(st.beta[i])-ref[i][1]) for i in range(n)))
    for iters in (1,3,7):
        st,info=si.infer.geometric_beta(s,a0,b0,method="plugin",include_self=inc,offset=off,max_distance=maxd,tol=0.0,max_iters=iters)
        ref=np_plugin(s,inc,off,maxd,iters)
        print("  plugin it",iters,"attn diff",max(np.abs(np.asarray(st.attention[i])-ref[i][0]).max() for i in range(n)),"alpha",max(abs(float(st.alpha[i])-ref[i][1]) for i in range(n)),"beta",max(abs(float(st.beta[i])-ref[i][2]) for i in range(n)),"win",max(abs(int(st.window[i])-ref[i][3]) for i in range(n)))
