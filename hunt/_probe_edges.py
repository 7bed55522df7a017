import numpy as np, jax, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
import structinfer as si
D=si.diagnostics
rng=np.random.default_rng(0)
n,m,off=4,7,3
a=rng.dirichlet(np.ones(m)*0.3,size=(2,n))
d=np.arange(n)[:,None]+off-np.arange(m)[None,:]
ed=(a*d).sum(-1); print("expected_distance", np.abs(np.asarray(D.expected_distance(a,off))-ed).max())
prior=si.priors.Geometric(0.3, m, offset=off)
print("via prior offset", np.abs(np.asarray(D.expected_distance(a,prior))-ed).max())
for mass in (0.5,0.9,1.0):
    ref=np.zeros((2,n))
    for b in range(2):
        for i in range(n):
            for w in range(0,50):
                if a[b,i][np.abs(d[i])<=w].sum()>=mass-1e-12: ref[b,i]=w; break
    print("window", mass, np.abs(np.asarray(D.effective_window(a,off,mass))-ref).max())
ds,p=D.distance_posterior(a,off)
ref=np.array([[a[b][d==x].sum()/n for x in ds] for b in range(2)])
print("distance_posterior", np.abs(np.asarray(p)-ref).max(), ds.min(), ds.max(), d.min(), d.max())
H=-(a*np.log(a)).sum(-1); print("entropy", np.abs(np.asarray(D.edge_entropy(a))-H).max())
# rows with exact zeros & NaN
z=np.array([[1.0,0.0,0.0],[np.nan,0.5,0.5]]); print("entropy with zero/nan rows", np.asarray(D.edge_entropy(z)), np.asarray(D.effective_window(z)), np.asarray(D.expected_distance(z)))
