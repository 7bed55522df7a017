import numpy as np, jax, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
import structinfer as si
from scipy.special import logsumexp
from scipy.stats import norm
rng=np.random.default_rng(0)
T,d,K=12,2,2
x=np.cumsum(rng.normal(size=(T,d)),0)*0.3
A=np.stack([np.eye(d)*0.9, np.eye(d)*0.5]); b=rng.normal(size=(K,d))*0.1; prec=np.ones((K,d))*[[1.],[3.]]
lt=np.log(np.array([[0.8,0.2],[0.3,0.7]])); li=np.log(np.array([0.6,0.4]))
def fb(A,b,prec,lt,li):
    u,y=x[:-1],x[1:]
    le=np.stack([norm.logpdf(y, u@A[k].T+b[k], 1/np.sqrt(prec[k])).sum(1) for k in range(K)],1)
    n=len(u); la=np.zeros((n,K)); lb=np.zeros((n,K))
    la[0]=li+le[0]
    for t in range(1,n): la[t]=le[t]+logsumexp(la[t-1][:,None]+lt,0)
    for t in range(n-2,-1,-1): lb[t]=logsumexp(lt+le[t+1]+lb[t+1],1)
    ll=logsumexp(la[-1]); g=np.exp(la+lb-ll)
    xi=np.zeros((K,K))
    for t in range(n-1): xi+=np.exp(la[t][:,None]+lt+le[t+1][None]+lb[t+1][None]-ll)
    return ll,g,xi
ll,g,xi=fb(A,b,prec,lt,li)
st=si.infer.em_markov_switching.init(x,A,b,prec,lt,li)
print("ll", float(st.log_likelihood), ll)
print("gamma diff", np.abs(np.asarray(st.responsibilities)-g).max(), "counts diff", np.abs(np.asarray(st.transitions)-xi).max())
# M-step numpy
u,y=x[:-1],x[1:]; ut=np.c_[u,np.ones(len(u))]
An,bn,pn=[],[],[]
for k in range(K):
    W=g[:,k]; G=(ut*W[:,None]).T@ut; C=(y*W[:,None]).T@ut; Ab=C@np.linalg.inv(G+1e-6*np.eye(d+1))
    An.append(Ab[:,:-1]); bn.append(Ab[:,-1]); e=y-u@Ab[:,:-1].T-Ab[:,-1]; pn.append(1/((W[:,None]*e*e).sum(0)/W.sum()+1e-6))
P=xi/xi.sum(1,keepdims=True)
st2,_=si.infer.em_markov_switching.step(x,st)
print("A diff", np.abs(np.asarray(st2.A)-np.array(An)).max(), "prec diff", np.abs(np.asarray(st2.precisions)-np.array(pn)).max(),
      "P diff", np.abs(np.exp(np.asarray(st2.log_transition))-P).max(), "pi diff", np.abs(np.exp(np.asarray(st2.log_initial))-g[0]).max())
ll2,_,_=fb(np.array(An),np.array(bn),np.array(pn),np.log(P),np.log(g[0]))
print("ll2", float(st2.log_likelihood), ll2)
st3,info=si.infer.markov_switching_em(x,A,b,prec,lt,li,max_iters=50)
e=np.asarray(info.energy); e=e[np.isfinite(e)]; print("monotone", np.all(np.diff(e)<=1e-9), e[:3], e[-1])
print("--- forbidden move 0->1")
lt2=np.log(np.array([[1.0,0.0],[0.3,0.7]]))
with np.errstate(divide="ignore"):
    ll,g,xi=fb(A,b,prec,lt2,li)
st=si.infer.em_markov_switching.init(x,A,b,prec,lt2,li)
print("ll", float(st.log_likelihood), ll, "gamma diff", np.abs(np.asarray(st.responsibilities)-g).max(), "counts", np.asarray(st.transitions).round(4).tolist(), "ref", xi.round(4).tolist())
st3,info=si.infer.markov_switching_em(x,A,b,prec,lt2,li,max_iters=20); print("P after EM", np.exp(np.asarray(st3.log_transition)).round(4).tolist(), "ll", float(st3.log_likelihood))
xs=jnp.asarray(x,jnp.float32)
stj,_=jax.jit(lambda x: si.infer.markov_switching_em(x,A,b,prec,lt2,li,max_iters=20))(xs); print("jit f32 ll", float(stj.log_likelihood))
