import numpy as np, jax, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
import structinfer as si
from scipy.stats import multivariate_normal as mvn
from scipy.special import logsumexp
rng=np.random.default_rng(0)
T,du,dy,K=40,2,3,2
u=rng.normal(size=(T,du)); Atrue=rng.normal(size=(K,dy,du)); z=rng.integers(0,K,T)
y=np.einsum("tij,tj->ti",Atrue[z],u)+0.3*rng.normal(size=(T,dy))
A=rng.normal(size=(K,dy,du))*0.5; b=np.zeros((K,dy)); C=np.stack([np.eye(dy)]*K); w=np.array([0.4,0.6])
def em(A,b,C,w,it,reg):
    for _ in range(it):
        L=np.stack([np.log(w[k])+mvn(np.zeros(dy),C[k]).logpdf(y-u@A[k].T-b[k]) for k in range(K)],1)
        r=np.exp(L-logsumexp(L,1,keepdims=True)); ut=np.c_[u,np.ones(T)]
        A2,b2,C2=[],[],[]
        for k in range(K):
            G=(ut*r[:,k,None]).T@ut+reg*np.eye(du+1); Ab=((y*r[:,k,None]).T@ut)@np.linalg.inv(G)
            e=y-ut@Ab.T; A2.append(Ab[:,:-1]); b2.append(Ab[:,-1]); C2.append((e*r[:,k,None]).T@e/r[:,k].sum()+reg*np.eye(dy))
        A,b,C,w=np.array(A2),np.array(b2),np.array(C2),r.mean(0)
    L=np.stack([np.log(w[k])+mvn(np.zeros(dy),C[k]).logpdf(y-u@A[k].T-b[k]) for k in range(K)],1)
    return A,b,C,w,logsumexp(L,1).sum()
for reg in (0.0,0.1):
    st,info=si.infer.linear_mixture_em(u,y,A,b,C,w,reg=reg,max_iters=6,tol=0.0)
    An,bn,Cn,wn,ll=em(A,b,C,w,6,reg)
    print("reg",reg,"ll",float(st.log_likelihood),ll,"A",np.abs(np.asarray(st.A)-An).max(),"C",np.abs(np.asarray(st.covariances)-Cn).max(),"w",np.abs(np.asarray(st.weights)-wn).max())
