// Reductions along one dim of a tensor seen as [outer, extent, inner] (ops::sum_dim,
// ops::max_dim) and their backward. One thread per output element, looping over the
// reduced dim in index order: the CPU's order, so sum_dim's bits match it exactly.

template <class T> __device__ void sum_dim_k(const T* x, T* out, u64 outer, u64 extent, u64 inner) {
    GRID_STRIDE(o, outer * inner) {
        u64 b = o / inner, i = o % inner;
        typename Tr<T>::A acc = 0;
        for (u64 e = 0; e < extent; ++e) acc += Tr<T>::to(x[(b * extent + e) * inner + i]);
        out[o] = Tr<T>::from(acc);
    }
}
// dx[b, e, i] = dy[b, i].
template <class T> __device__ void sum_dim_back_k(const T* dy, T* dx, u64 outer, u64 extent, u64 inner) {
    GRID_STRIDE(o, outer * extent * inner) {
        u64 i = o % inner, b = o / (extent * inner);
        dx[o] = dy[b * inner + i];
    }
}
// The first maximum; a NaN wins (the first NaN), as in PyTorch and the CPU kernel.
template <class T>
__device__ void max_dim_k(const T* x, T* values, i64* indices, u64 outer, u64 extent, u64 inner) {
    GRID_STRIDE(o, outer * inner) {
        u64 b = o / inner, i = o % inner;
        typename Tr<T>::A best = Tr<T>::to(x[b * extent * inner + i]);
        u64 arg = 0;
        for (u64 e = 1; e < extent; ++e) {
            if (is_nan(best)) break;
            typename Tr<T>::A c = Tr<T>::to(x[(b * extent + e) * inner + i]);
            if (c > best || is_nan(c)) { best = c; arg = e; }
        }
        values[o] = x[(b * extent + arg) * inner + i];
        indices[o] = (i64)arg;
    }
}
// dx = 0 except dx[b, idx[b, i], i] = dy[b, i]. Indices are checked on the host.
template <class T>
__device__ void max_dim_back_k(const T* dy, const i64* idx, T* dx, u64 outer, u64 extent, u64 inner) {
    GRID_STRIDE(o, outer * extent * inner) {
        u64 i = o % inner, e = (o / inner) % extent, b = o / (extent * inner);
        u64 src = b * inner + i;
        dx[o] = ((u64)idx[src] == e) ? dy[src] : Tr<T>::from((typename Tr<T>::A)0);
    }
}

#define RED_ENTRIES(N, T)                                                                                  \
    extern "C" __global__ void sum_dim_##N(const T* x, T* o, u64 outer, u64 extent, u64 inner) {           \
        sum_dim_k<T>(x, o, outer, extent, inner);                                                          \
    }                                                                                                      \
    extern "C" __global__ void sum_dim_backward_##N(const T* dy, T* dx, u64 outer, u64 extent, u64 inner) { \
        sum_dim_back_k<T>(dy, dx, outer, extent, inner);                                                   \
    }                                                                                                      \
    extern "C" __global__ void max_dim_##N(const T* x, T* v, i64* ix, u64 outer, u64 extent, u64 inner) {  \
        max_dim_k<T>(x, v, ix, outer, extent, inner);                                                      \
    }                                                                                                      \
    extern "C" __global__ void max_dim_backward_##N(const T* dy, const i64* ix, T* dx, u64 outer,          \
                                                    u64 extent, u64 inner) {                               \
        max_dim_back_k<T>(dy, ix, dx, outer, extent, inner);                                               \
    }
FLOATS(RED_ENTRIES)
