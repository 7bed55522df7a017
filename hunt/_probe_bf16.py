import numpy as np, jax, jax.numpy as jnp
import structinfer as si
D = si.diagnostics
n=1024
rng=np.random.default_rng(0)
s=rng.normal(size=(n,n))*0.5
mask=np.tril(np.ones((n,n),bool))
a64=np.exp(np.where(mask,s,-np.inf)-np.where(mask,s,-np.inf).max(1,keepdims=True)); a64/=a64.sum(1,keepdims=True)
for dt in (jnp.float32, jnp.bfloat16):
    a=jnp.asarray(a64,dt)
    a_exact=np.asarray(a.astype(jnp.float32),np.float64)  # the bf16 values themselves, exactly
    d=np.arange(n)[:,None]-np.arange(n)[None,:]
    ed=np.asarray(D.expected_distance(a),np.float64); ref=(a_exact*d).sum(1)
    H=np.asarray(D.edge_entropy(a),np.float64); Href=-(np.where(a_exact>0,a_exact*np.log(np.where(a_exact>0,a_exact,1)),0)).sum(1)
    w=np.asarray(D.effective_window(a,mass=0.9),np.float64)
    print(dt.__name__ if hasattr(dt,'__name__') else dt, "expected_distance max rel err", np.nanmax(np.abs(ed-ref)/np.maximum(ref,1)), "at row", np.nanargmax(np.abs(ed-ref)/np.maximum(ref,1)),
          "| entropy max abs err", np.abs(H-Href).max(), "| window nan rows", np.isnan(w).sum())
    print("  dtypes", D.expected_distance(a).dtype, D.edge_entropy(a).dtype, D.effective_window(a).dtype)
    i=n-1; print("  last row: expected_distance", ed[i], "ref", ref[i], "entropy", H[i], "ref", Href[i])
