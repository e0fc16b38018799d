// Mixture-of-experts: scatter_add_rows (ops::scatter_add_rows), the adjoint of a row gather:
// out[r, :] = sum of src[i, :] over the i with rows[i] = r. The grouped products
// (grouped_matmul_t and its backward) are cuBLAS GEMMs, one per expert (see model_ops.rs).
//
// Deterministic without float atomics, and bitwise the CPU's result: the host sorts the
// source rows by destination (stably, so each destination keeps the source order) and uploads
// them as CSR, starts[r]..starts[r + 1] indexing `sources`. One thread per output element sums
// its sources in that order in f64 from 0.0, then rounds once into T: exactly the CPU's
// to_f64 / += in source order / from_f64_vec (Tensor::to_dtype's rounding, cast_from_f64).

template <class T>
__device__ void scatter_add_rows_k(const T* src, const i64* starts, const i64* sources, T* out, u64 n, u64 h) {
    GRID_STRIDE(o, n * h) {
        u64 r = o / h, c = o % h;
        double acc = 0.0;
        for (i64 k = starts[r]; k < starts[r + 1]; ++k) acc += cast_in(src[(u64)sources[k] * h + c]);
        out[o] = cast_from_f64<T>(acc);
    }
}

#define MOE_ENTRIES(N, T)                                                                                \
    extern "C" __global__ void scatter_add_rows_##N(const T* src, const i64* starts, const i64* sources, \
                                                    T* out, u64 n, u64 h) {                              \
        scatter_add_rows_k<T>(src, starts, sources, out, n, h);                                          \
    }
ALL_TYPES(MOE_ENTRIES)
