// The collectives' element-wise reductions on device buffers, bitwise the CPU's
// `reduce::combine` and `Element::div_count` (kernels/src/reduce.rs, dtype.rs):
// - Sum (and Avg, which sums first): acc = round(acc + src) in the compute type (integers wrap).
// - Max / Min: src replaces acc only when src > acc (src < acc), compared as values in the
//   compute type; otherwise acc keeps its bits. So a NaN src is ignored, a NaN acc stays, and
//   of +0 / -0 the accumulator's sign stays: Element::max_of / min_of exactly.
// - Avg's final division: acc / count with count converted as Rust's `as` does (round to
//   nearest for floats, truncating for i32), rounded once; integers divide toward zero.

template <class T> __device__ void reduce_combine_k(T* acc, const T* src, u64 n, int op) {
    GRID_STRIDE(i, n) {
        T a = acc[i], s = src[i];
        typename Tr<T>::A x = Tr<T>::to(a), y = Tr<T>::to(s);
        if (op == 0) {
            acc[i] = Tr<T>::from(x + y);
        } else if (op == 1) {
            if (y > x) acc[i] = s;
        } else {
            if (y < x) acc[i] = s;
        }
    }
}

__device__ __forceinline__ float div_count(float a, u64 n) { return a / (float)n; }
__device__ __forceinline__ double div_count(double a, u64 n) { return a / (double)n; }
__device__ __forceinline__ bf16 div_count(bf16 a, u64 n) { return f32_to_bf16(bf16_to_f32(a) / (float)n); }
__device__ __forceinline__ f16 div_count(f16 a, u64 n) { return f32_to_f16(f16_to_f32(a) / (float)n); }
__device__ __forceinline__ int div_count(int a, u64 n) { return a / (int)n; }
__device__ __forceinline__ i64 div_count(i64 a, u64 n) { return a / (i64)n; }

template <class T> __device__ void reduce_avg_div_k(T* acc, u64 n, u64 count) {
    GRID_STRIDE(i, n) acc[i] = div_count(acc[i], count);
}

#define REDUCE_ENTRIES(N, T)                                                                         \
    extern "C" __global__ void reduce_combine_##N(T* acc, const T* src, u64 n, int op) {             \
        reduce_combine_k<T>(acc, src, n, op);                                                        \
    }                                                                                                \
    extern "C" __global__ void reduce_avg_div_##N(T* acc, u64 n, u64 count) {                        \
        reduce_avg_div_k<T>(acc, n, count);                                                          \
    }
ALL_TYPES(REDUCE_ENTRIES)
