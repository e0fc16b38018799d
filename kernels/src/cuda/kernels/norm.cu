// LayerNorm and RMSNorm over the last dim (ops::layer_norm, ops::rms_norm), forward and
// backward, with the CPU's formulas (two-pass variance, statistics kept in the compute type).
// Forward and dx: one block of ROW_THREADS per row (row sums are fixed-order block trees:
// deterministic, equal to the CPU to rounding). dweight/dbias: one thread per column summing
// the rows in order in the compute type, as the CPU does (bitwise, given the same stats).
// `layer` is 1 for LayerNorm (mean subtracted, bias added), 0 for RMSNorm (mean, b, db unused).

template <class T>
__device__ void norm_fwd_k(int layer, T* y, typename Tr<T>::A* mean, typename Tr<T>::A* rstd, const T* x,
                           const T* w, const T* b, u64 n, typename Tr<T>::A eps) {
    typedef typename Tr<T>::A A;
    u64 r = blockIdx.x;
    const T* xr = x + r * n;
    T* yr = y + r * n;
    A nn = (A)n;
    A mu = 0;
    if (layer) {
        A s = 0;
        for (u64 j = threadIdx.x; j < n; j += blockDim.x) s += Tr<T>::to(xr[j]);
        mu = block_sum(s) / nn;
    }
    A v = 0;
    for (u64 j = threadIdx.x; j < n; j += blockDim.x) {
        A c = Tr<T>::to(xr[j]) - mu;
        v += c * c;
    }
    A var = block_sum(v);
    A rs = (A)1 / sq(var / nn + eps);
    if (threadIdx.x == 0) {
        rstd[r] = rs;
        if (layer) mean[r] = mu;
    }
    for (u64 j = threadIdx.x; j < n; j += blockDim.x) {
        if (layer)
            yr[j] = Tr<T>::from((Tr<T>::to(xr[j]) - mu) * rs * Tr<T>::to(w[j]) + Tr<T>::to(b[j]));
        else
            yr[j] = Tr<T>::from(Tr<T>::to(xr[j]) * rs * Tr<T>::to(w[j]));
    }
}

// dx = rstd*(g - mean(g) - xhat*mean(g*xhat)) (LayerNorm), rstd*(g - xhat*mean(g*xhat)) (RMS),
// g = dy*w.
template <class T>
__device__ void norm_dx_k(int layer, T* dx, const T* dy, const T* x, const T* w, const typename Tr<T>::A* mean,
                          const typename Tr<T>::A* rstd, u64 n) {
    typedef typename Tr<T>::A A;
    u64 r = blockIdx.x;
    u64 base = r * n;
    A mu = layer ? mean[r] : (A)0;
    A rs = rstd[r];
    A sg = 0, sgx = 0;
    for (u64 j = threadIdx.x; j < n; j += blockDim.x) {
        A xh = (Tr<T>::to(x[base + j]) - mu) * rs;
        A g = Tr<T>::to(dy[base + j]) * Tr<T>::to(w[j]);
        sg += g;
        sgx += g * xh;
    }
    sg = block_sum(sg);
    sgx = block_sum(sgx);
    A nn = (A)n;
    A c0 = layer ? sg / nn : (A)0;
    A c1 = sgx / nn;
    for (u64 j = threadIdx.x; j < n; j += blockDim.x) {
        A xh = (Tr<T>::to(x[base + j]) - mu) * rs;
        A g = Tr<T>::to(dy[base + j]) * Tr<T>::to(w[j]);
        dx[base + j] = Tr<T>::from(rs * (g - c0 - xh * c1));
    }
}

// dw[j] = sum_r dy*xhat, db[j] = sum_r dy (LayerNorm only), rows in order.
template <class T>
__device__ void norm_dw_k(int layer, T* dw, T* db, const T* dy, const T* x, const typename Tr<T>::A* mean,
                          const typename Tr<T>::A* rstd, u64 rows, u64 n) {
    typedef typename Tr<T>::A A;
    GRID_STRIDE(j, n) {
        A aw = 0, ab = 0;
        for (u64 r = 0; r < rows; ++r) {
            A d = Tr<T>::to(dy[r * n + j]);
            A mu = layer ? mean[r] : (A)0;
            A xh = (Tr<T>::to(x[r * n + j]) - mu) * rstd[r];
            aw += d * xh;
            ab += d;
        }
        dw[j] = Tr<T>::from(aw);
        if (layer) db[j] = Tr<T>::from(ab);
    }
}

#define NORM_ENTRIES(N, T)                                                                                  \
    extern "C" __global__ void layer_norm_##N(T* y, Tr<T>::A* mean, Tr<T>::A* rstd, const T* x, const T* w, \
                                              const T* b, u64 n, Tr<T>::A eps) {                            \
        norm_fwd_k<T>(1, y, mean, rstd, x, w, b, n, eps);                                                   \
    }                                                                                                       \
    extern "C" __global__ void rms_norm_##N(T* y, Tr<T>::A* rstd, const T* x, const T* w, u64 n,            \
                                            Tr<T>::A eps) {                                                 \
        norm_fwd_k<T>(0, y, rstd, rstd, x, w, w, n, eps);                                                   \
    }                                                                                                       \
    extern "C" __global__ void layer_norm_backward_dx_##N(T* dx, const T* dy, const T* x, const T* w,       \
                                                          const Tr<T>::A* mean, const Tr<T>::A* rstd, u64 n) { \
        norm_dx_k<T>(1, dx, dy, x, w, mean, rstd, n);                                                       \
    }                                                                                                       \
    extern "C" __global__ void rms_norm_backward_dx_##N(T* dx, const T* dy, const T* x, const T* w,         \
                                                        const Tr<T>::A* rstd, u64 n) {                      \
        norm_dx_k<T>(0, dx, dy, x, w, rstd, rstd, n);                                                       \
    }                                                                                                       \
    extern "C" __global__ void layer_norm_backward_dw_##N(T* dw, T* db, const T* dy, const T* x,            \
                                                          const Tr<T>::A* mean, const Tr<T>::A* rstd,       \
                                                          u64 rows, u64 n) {                                \
        norm_dw_k<T>(1, dw, db, dy, x, mean, rstd, rows, n);                                                \
    }                                                                                                       \
    extern "C" __global__ void rms_norm_backward_dw_##N(T* dw, const T* dy, const T* x,                     \
                                                        const Tr<T>::A* rstd, u64 rows, u64 n) {            \
        norm_dw_k<T>(0, dw, dw, dy, x, rstd, rstd, rows, n);                                                \
    }
FLOATS(NORM_ENTRIES)
