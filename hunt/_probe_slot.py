import numpy as np, jax, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
import structinfer as si
from scipy.special import logsumexp, softmax
rng=np.random.default_rng(0)
x=np.concatenate([rng.normal(size=(10,3))*0.3+[2,0,0], rng.normal(size=(10,3))*0.3+[0,2,0]])
slots=x[[0,15]][:, :2]*0.5; wk=rng.normal(size=(2,3))*0.5; wq=np.eye(2)
st,info=si.infer.slot_em(x,slots,wk,wq,max_iters=10,e_iters=200)
mu,WK,WQ,A=(np.asarray(a) for a in (st.slots,st.wk,st.wq,st.attention))
k=x@WK.T; sc=k@(mu@WQ.T).T  # (tokens, slots)
Aref=softmax(sc,1); lz=(logsumexp(sc,1)-np.log(2)).sum()
print("attention diff", np.abs(A-Aref).max())
print("fixed point mu = WQ^T sum_j A_ji k_j:", np.abs(mu - (A.T@k)@WQ).max())
print("energy", float(st.energy), "ref 0.5|mu|^2 - logZ", 0.5*(mu**2).sum()-lz)
print("converged", bool(info.converged), int(info.num_steps))
# m_step untied whiten=False vs direct lstsq
wk2,wq2=si.infer.slot_m_step(jnp.asarray(x),jnp.asarray(mu),jnp.asarray(A),jnp.asarray(WK),jnp.asarray(WQ),whiten=False)
cmm=np.einsum("js,sa,sb->ab",A,mu,mu); cxm=np.einsum("js,ja,sb->ab",A,x,mu); cxx=np.einsum("js,ja,jb->ab",A,x,x)
wq_ref=WK@cxm@np.linalg.pinv(cmm); wk_ref=wq_ref@cxm.T@np.linalg.pinv(cxx)
print("m_step diffs", np.abs(np.asarray(wq2)-wq_ref).max(), np.abs(np.asarray(wk2)-wk_ref).max())
