// Elementwise arithmetic, the bias row ops, their column sums, and dtype casts.
// Same rounding as the CPU: compute in Tr<T>::A, round once into T.

// out = a + b (Tensor::add), all six dtypes; integers wrap.
template <class T> __device__ void add_k(const T* a, const T* b, T* out, u64 n) {
    GRID_STRIDE(i, n) out[i] = Tr<T>::from(Tr<T>::to(a[i]) + Tr<T>::to(b[i]));
}
// out = a * b (Tensor::mul).
template <class T> __device__ void mul_k(const T* a, const T* b, T* out, u64 n) {
    GRID_STRIDE(i, n) out[i] = Tr<T>::from(Tr<T>::to(a[i]) * Tr<T>::to(b[i]));
}
// out = a * f (Tensor::scale): `f` is the factor already rounded into T (by the host) and
// widened to the compute type.
template <class T> __device__ void scale_k(const T* a, T* out, typename Tr<T>::A f, u64 n) {
    GRID_STRIDE(i, n) out[i] = Tr<T>::from(Tr<T>::to(a[i]) * f);
}
// out = a - b (ops::sub), floats.
template <class T> __device__ void sub_k(const T* a, const T* b, T* out, u64 n) {
    GRID_STRIDE(i, n) out[i] = Tr<T>::from(Tr<T>::to(a[i]) - Tr<T>::to(b[i]));
}
// out[r, j] = x[r, j] + bias[j] (ops::add_row; out may be x).
template <class T> __device__ void add_row_k(const T* x, const T* bias, T* out, u64 rows, u64 n) {
    GRID_STRIDE(i, rows * n) out[i] = Tr<T>::from(Tr<T>::to(x[i]) + Tr<T>::to(bias[i % n]));
}
// out[r, j] = x[r, j] * w[j] (ops::mul_row).
template <class T> __device__ void mul_row_k(const T* x, const T* w, T* out, u64 rows, u64 n) {
    GRID_STRIDE(i, rows * n) out[i] = Tr<T>::from(Tr<T>::to(x[i]) * Tr<T>::to(w[i % n]));
}
// dst[j] (=|+=) sum_r x[r, j] (ops::sum_rows): one thread per column, rows in order, in the
// compute type: the CPU's summation order exactly.
template <class T> __device__ void sum_rows_k(T* dst, const T* x, u64 rows, u64 n, int accum) {
    GRID_STRIDE(j, n) {
        typename Tr<T>::A acc = 0;
        for (u64 r = 0; r < rows; ++r) acc += Tr<T>::to(x[r * n + j]);
        store(dst + j, acc, accum);
    }
}

#define EW_ALL(N, T)                                                                                  \
    extern "C" __global__ void add_##N(const T* a, const T* b, T* o, u64 n) { add_k<T>(a, b, o, n); } \
    extern "C" __global__ void mul_##N(const T* a, const T* b, T* o, u64 n) { mul_k<T>(a, b, o, n); } \
    extern "C" __global__ void scale_##N(const T* a, T* o, Tr<T>::A f, u64 n) { scale_k<T>(a, o, f, n); }
ALL_TYPES(EW_ALL)

#define EW_FLOAT(N, T)                                                                                     \
    extern "C" __global__ void sub_##N(const T* a, const T* b, T* o, u64 n) { sub_k<T>(a, b, o, n); }      \
    extern "C" __global__ void add_row_##N(const T* x, const T* b, T* o, u64 rows, u64 n) {               \
        add_row_k<T>(x, b, o, rows, n);                                                                    \
    }                                                                                                      \
    extern "C" __global__ void mul_row_##N(const T* x, const T* w, T* o, u64 rows, u64 n) {               \
        mul_row_k<T>(x, w, o, rows, n);                                                                    \
    }                                                                                                      \
    extern "C" __global__ void sum_rows_##N(T* d, const T* x, u64 rows, u64 n, int accum) {               \
        sum_rows_k<T>(d, x, rows, n, accum);                                                               \
    }
FLOATS(EW_FLOAT)

// Casts, as Tensor::to_dtype: cast_in / cast_from_f64 (common.cuh).
template <class S, class D> __device__ void cast_k(const S* src, D* dst, u64 n) {
    GRID_STRIDE(i, n) dst[i] = cast_from_f64<D>(cast_in(src[i]));
}

#define CAST_TO(SN, S) \
    CAST_ONE(SN, S, f32, float) CAST_ONE(SN, S, f64, double) CAST_ONE(SN, S, bf16, bf16) \
    CAST_ONE(SN, S, f16, f16) CAST_ONE(SN, S, i32, int) CAST_ONE(SN, S, i64, i64)
#define CAST_ONE(SN, S, DN, D) \
    extern "C" __global__ void cast_##SN##_##DN(const S* s, D* d, u64 n) { cast_k<S, D>(s, d, n); }
ALL_TYPES(CAST_TO)
