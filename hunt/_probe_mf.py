import numpy as np, jax, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
import structinfer as si
from scipy.special import betaln, logsumexp
rng=np.random.default_rng(1)
n=6; s=rng.normal(size=(n,n))*2
a0,b0=0.1,0.9
for inc in (True, False):
  st,info=si.infer.geometric_beta(s,a0,b0,method="exact",include_self=inc, max_iters=500, tol=1e-12)
  d0=0 if inc else 1
  for i in range(n):
    ks=[(j, i-j-d0) for j in range(n) if i-j-d0>=0]
    if not ks: continue
    lz=logsumexp([s[i,j]+betaln(a0+1,b0+k)-betaln(a0,b0) for j,k in ks])
    post=np.zeros(n); 
    for j,k in ks: post[j]=np.exp(s[i,j]+betaln(a0+1,b0+k)-betaln(a0,b0)-lz)
    print(inc,i,"F",float(st.energy[i]),">= -logZ",-lz, "TV", 0.5*np.abs(np.asarray(st.attention[i])-post).sum(), "bound", np.sqrt(max(float(st.energy[i])+lz,0)/2))
