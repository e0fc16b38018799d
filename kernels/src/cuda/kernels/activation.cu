// GELU (tanh form, as x*sigmoid(2u)), SiLU and SwiGLU with their backward: the CPU's
// formulas (kernels/src/ops/activation.rs) operation for operation, with its exp
// (exp_fast) in f32, so f32/bf16/f16 results match the CPU bit for bit.

#define GELU_C 0.7978845608028654
#define GELU_A 0.044715

template <class A> __device__ __forceinline__ A sigmoid(A z) {
    if (z < (A)-80.0) return (A)0;
    return (A)1 / ((A)1 + exp_fast(-z));
}
template <class A> __device__ __forceinline__ A gelu_f(A x) {
    A u = (A)GELU_C * (x + (A)GELU_A * x * x * x);
    return x * sigmoid(u + u);
}
template <class A> __device__ __forceinline__ A gelu_grad(A x) {
    A x2 = x * x;
    A u = (A)GELU_C * x * ((A)1 + (A)GELU_A * x2);
    A s = sigmoid(u + u);
    A ds = s * ((A)1 - s);
    if (ds == (A)0) return s;
    return s + x * ds * (A)(2.0 * GELU_C) * ((A)1 + (A)(3.0 * GELU_A) * x2);
}
template <class A> __device__ __forceinline__ A silu_f(A x) { return x * sigmoid(x); }
template <class A> __device__ __forceinline__ A silu_grad(A x) {
    A s = sigmoid(x);
    if (s == (A)0) return (A)0;
    return s * ((A)1 + x * ((A)1 - s));
}

#define ACT(NAME, F, GRAD)                                                                        \
    template <class T> __device__ void NAME##_k(const T* x, T* y, u64 n) {                       \
        GRID_STRIDE(i, n) y[i] = Tr<T>::from(F(Tr<T>::to(x[i])));                                \
    }                                                                                             \
    template <class T> __device__ void NAME##_back_k(T* dx, const T* dy, const T* x, u64 n, int accum) { \
        GRID_STRIDE(i, n) store(dx + i, Tr<T>::to(dy[i]) * GRAD(Tr<T>::to(x[i])), accum);       \
    }
ACT(gelu, gelu_f, gelu_grad)
ACT(silu, silu_f, silu_grad)

// y = silu(gate) * up.
template <class T> __device__ void swiglu_k(const T* g, const T* u, T* y, u64 n) {
    GRID_STRIDE(i, n) y[i] = Tr<T>::from(silu_f(Tr<T>::to(g[i])) * Tr<T>::to(u[i]));
}
// d_gate = dy*up*silu'(gate), d_up = dy*silu(gate).
template <class T>
__device__ void swiglu_back_k(T* dg, T* du, const T* dy, const T* g, const T* u, u64 n, int accum) {
    GRID_STRIDE(i, n) {
        typename Tr<T>::A gi = Tr<T>::to(g[i]), ui = Tr<T>::to(u[i]), d = Tr<T>::to(dy[i]);
        store(dg + i, d * ui * silu_grad(gi), accum);
        store(du + i, d * silu_f(gi), accum);
    }
}

#define ACT_ENTRIES(N, T)                                                                                   \
    extern "C" __global__ void gelu_##N(const T* x, T* y, u64 n) { gelu_k<T>(x, y, n); }                    \
    extern "C" __global__ void gelu_backward_##N(T* dx, const T* dy, const T* x, u64 n, int accum) {        \
        gelu_back_k<T>(dx, dy, x, n, accum);                                                                \
    }                                                                                                       \
    extern "C" __global__ void silu_##N(const T* x, T* y, u64 n) { silu_k<T>(x, y, n); }                    \
    extern "C" __global__ void silu_backward_##N(T* dx, const T* dy, const T* x, u64 n, int accum) {        \
        silu_back_k<T>(dx, dy, x, n, accum);                                                                \
    }                                                                                                       \
    extern "C" __global__ void swiglu_##N(const T* g, const T* u, T* y, u64 n) { swiglu_k<T>(g, u, y, n); } \
    extern "C" __global__ void swiglu_backward_##N(T* dg, T* du, const T* dy, const T* g, const T* u,      \
                                                   u64 n, int accum) {                                      \
        swiglu_back_k<T>(dg, du, dy, g, u, n, accum);                                                       \
    }
FLOATS(ACT_ENTRIES)
