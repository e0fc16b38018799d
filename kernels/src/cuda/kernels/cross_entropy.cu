// The local pieces of the (vocab-parallel) cross-entropy (DTensor::cross_entropy), in f64 as
// the CPU computes it, with the all-reduces over the vocab axes between them:
//   1. ce_row_max: m[r] = max_c logits[r, c]                      -> all_reduce(Max)
//   2. ce_sum_target: s[r] = sum_c exp(l - m), t[r] = l[r, id - col_start] - m if the target
//      column is here, else 0                                      -> all_reduce(Sum) of s and t
//   3. ce_loss: loss[r] = ln s[r] - t[r] (+ z * lse^2, lse = m + ln s, with a z-loss z > 0),
//      rounded into the logits' dtype
//   4. ce_grad: dl[r, c] = (exp(l - m)/s * (1 + 2 z lse) - [c == id - col_start]) * dy[r]
// With z = 0 no z term is computed (no "+ 0", no "* 1"): the plain cross-entropy's bits.
// An ignored row has id -1 (the front door's mark): s = t = 0 in step 2 (on every rank, so
// after the all-reduce too), loss 0 where s is 0 in step 3 (a scored row's s is >= 1), and a
// zero gradient row.
// One block of ROW_THREADS per row (fixed-order block trees).

template <class T> __device__ void ce_row_max_k(const T* l, double* m, u64 cols) {
    u64 r = blockIdx.x;
    double v = neg_inf<double>();
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        double x = (double)Tr<T>::to(l[r * cols + c]);
        if (x > v) v = x;  // f64::max: a NaN never wins
    }
    v = block_max(v);
    if (threadIdx.x == 0) m[r] = v;
}

template <class T>
__device__ void ce_sum_target_k(const T* l, const double* m, const i64* ids, double* s, double* t, u64 cols,
                                u64 col_start) {
    u64 r = blockIdx.x;
    // The whole block takes the same branch: no thread is left waiting in block_sum.
    if (ids[r] < 0) {
        if (threadIdx.x == 0) s[r] = t[r] = 0.0;
        return;
    }
    double acc = 0;
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) acc += ex((double)Tr<T>::to(l[r * cols + c]) - m[r]);
    acc = block_sum(acc);
    if (threadIdx.x == 0) {
        s[r] = acc;
        u64 id = (u64)ids[r];
        t[r] = (id >= col_start && id - col_start < cols) ? (double)Tr<T>::to(l[r * cols + id - col_start]) - m[r] : 0.0;
    }
}

template <class T>
__device__ void ce_loss_k(const double* m, const double* s, const double* t, T* loss, double z, u64 rows) {
    GRID_STRIDE(r, rows) {
        double v = 0.0;
        if (s[r] != 0.0) {
            double ln = lg(s[r]);
            v = ln - t[r];
            if (z != 0.0) {
                double lse = m[r] + ln;
                v += z * lse * lse;
            }
        }
        loss[r] = cast_from_f64<T>(v);
    }
}

template <class T>
__device__ void ce_grad_k(T* dl, const T* l, const double* m, const double* s, const i64* ids, const T* dy, u64 cols,
                          u64 col_start, double z) {
    u64 r = blockIdx.x;
    if (ids[r] < 0) {
        for (u64 c = threadIdx.x; c < cols; c += blockDim.x) dl[r * cols + c] = cast_from_f64<T>(0.0);
        return;
    }
    u64 id = (u64)ids[r];
    double d = (double)Tr<T>::to(dy[r]);
    double k = z != 0.0 ? 1.0 + 2.0 * z * (m[r] + lg(s[r])) : 1.0;
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        double p = ex((double)Tr<T>::to(l[r * cols + c]) - m[r]) / s[r];
        if (z != 0.0) p *= k;
        if (id >= col_start && id - col_start == c) p -= 1.0;
        dl[r * cols + c] = cast_from_f64<T>(p * d);
    }
}

#define CE_ENTRIES(N, T)                                                                                       \
    extern "C" __global__ void ce_row_max_##N(const T* l, double* m, u64 cols) { ce_row_max_k<T>(l, m, cols); } \
    extern "C" __global__ void ce_sum_target_##N(const T* l, const double* m, const i64* ids, double* s,        \
                                                 double* t, u64 cols, u64 col_start) {                         \
        ce_sum_target_k<T>(l, m, ids, s, t, cols, col_start);                                                  \
    }                                                                                                          \
    extern "C" __global__ void ce_loss_##N(const double* m, const double* s, const double* t, T* loss,          \
                                           double z, u64 rows) {                                               \
        ce_loss_k<T>(m, s, t, loss, z, rows);                                                                  \
    }                                                                                                          \
    extern "C" __global__ void ce_grad_##N(T* dl, const T* l, const double* m, const double* s,                \
                                           const i64* ids, const T* dy, u64 cols, u64 col_start, double z) {   \
        ce_grad_k<T>(dl, l, m, s, ids, dy, cols, col_start, z);                                                \
    }
FLOATS(CE_ENTRIES)
