// Softmax and log-softmax along the last dim (ops::softmax, ops::log_softmax) and their
// backward from the forward output. One block of ROW_THREADS per row; the row's max and
// sums are block reductions in a fixed tree order (deterministic from run to run, but not
// the CPU's left-to-right order: results agree with the CPU to rounding, not bitwise).
// exp/log are CUDA's (within 1-2 ulp), as the CPU uses libm's.
// A NaN anywhere in a row makes the row NaN; -inf entries get probability 0.

template <class T> __device__ void softmax_row_k(const T* x, T* y, u64 n, int log_kind) {
    typedef typename Tr<T>::A A;
    const T* xr = x + (u64)blockIdx.x * n;
    T* yr = y + (u64)blockIdx.x * n;
    A m = neg_inf<A>();
    int nan = 0;
    for (u64 j = threadIdx.x; j < n; j += blockDim.x) {
        A v = Tr<T>::to(xr[j]);
        nan |= is_nan(v);
        if (v > m) m = v;
    }
    m = block_max(m);
    if (block_sum(nan) > 0) m = qnan<A>();
    A s = 0;
    for (u64 j = threadIdx.x; j < n; j += blockDim.x) s += ex(Tr<T>::to(xr[j]) - m);
    s = block_sum(s);
    if (log_kind) {
        A shift = m + lg(s);
        for (u64 j = threadIdx.x; j < n; j += blockDim.x) yr[j] = Tr<T>::from(Tr<T>::to(xr[j]) - shift);
    } else {
        for (u64 j = threadIdx.x; j < n; j += blockDim.x) yr[j] = Tr<T>::from(ex(Tr<T>::to(xr[j]) - m) / s);
    }
}

// softmax: dx = y*(dy - sum(dy*y)); log_softmax: dx = dy - ex(y)*sum(dy).
template <class T>
__device__ void softmax_back_row_k(T* dx, const T* dy, const T* y, u64 n, int log_kind, int accum) {
    typedef typename Tr<T>::A A;
    u64 base = (u64)blockIdx.x * n;
    A acc = 0;
    for (u64 j = threadIdx.x; j < n; j += blockDim.x) {
        A g = Tr<T>::to(dy[base + j]);
        acc += log_kind ? g : g * Tr<T>::to(y[base + j]);
    }
    acc = block_sum(acc);
    for (u64 j = threadIdx.x; j < n; j += blockDim.x) {
        A g = Tr<T>::to(dy[base + j]), p = Tr<T>::to(y[base + j]);
        A v = log_kind ? g - ex(p) * acc : p * (g - acc);
        store(dx + base + j, v, accum);
    }
}

#define SOFTMAX_ENTRIES(N, T)                                                                              \
    extern "C" __global__ void softmax_##N(const T* x, T* y, u64 n) { softmax_row_k<T>(x, y, n, 0); }      \
    extern "C" __global__ void log_softmax_##N(const T* x, T* y, u64 n) { softmax_row_k<T>(x, y, n, 1); }  \
    extern "C" __global__ void softmax_backward_##N(T* dx, const T* dy, const T* y, u64 n, int accum) {    \
        softmax_back_row_k<T>(dx, dy, y, n, 0, accum);                                                     \
    }                                                                                                      \
    extern "C" __global__ void log_softmax_backward_##N(T* dx, const T* dy, const T* y, u64 n, int accum) { \
        softmax_back_row_k<T>(dx, dy, y, n, 1, accum);                                                     \
    }
FLOATS(SOFTMAX_ENTRIES)
