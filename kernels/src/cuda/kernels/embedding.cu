// Embedding gather (ops::embedding, ops::embedding_masked) and its backward, a scatter-add
// into the table's rows (ops::embedding_backward / _masked_backward). Ids are checked on the
// host (out of range is an Err there).
//
// Deterministic scatter-add without float atomics: the host sorts the positions by table row
// (stably, so positions keep their order within a row, as the CPU does) and uploads them as
// CSR: `starts[r]..starts[r + 1]` index `positions`. One block per table row, one thread per
// hidden column, each summing its row's positions in order in the compute type: the CPU's
// order exactly, so the result is bitwise the CPU's. Rows no id hits are zeroed (Replace) or
// left alone (Add).

// out[p, :] = table[ids[p] - start, :] when the id falls in the shard [start, start + len),
// zeros otherwise.
template <class T, class I>
__device__ void gather_k(const T* table, const I* ids, T* out, u64 tokens, u64 hidden, u64 start, u64 len) {
    GRID_STRIDE(i, tokens * hidden) {
        u64 p = i / hidden, c = i % hidden;
        u64 id = (u64)ids[p];
        bool hit = id >= start && id - start < len;
        out[i] = hit ? table[(id - start) * hidden + c] : Tr<T>::from((typename Tr<T>::A)0);
    }
}

template <class T>
__device__ void scatter_k(T* dtable, const T* dy, const i64* starts, const i64* positions, u64 hidden, int accum) {
    u64 r = blockIdx.x;
    i64 a = starts[r], b = starts[r + 1];
    for (u64 c = threadIdx.x; c < hidden; c += blockDim.x) {
        typename Tr<T>::A acc = 0;
        for (i64 k = a; k < b; ++k) acc += Tr<T>::to(dy[(u64)positions[k] * hidden + c]);
        if (a == b && accum) continue;
        store(dtable + r * hidden + c, acc, accum);
    }
}

#define EMB_ENTRIES(N, T)                                                                                    \
    extern "C" __global__ void embedding_i64_##N(const T* t, const i64* ids, T* o, u64 tokens, u64 hidden,   \
                                                 u64 start, u64 len) {                                       \
        gather_k<T, i64>(t, ids, o, tokens, hidden, start, len);                                             \
    }                                                                                                        \
    extern "C" __global__ void embedding_i32_##N(const T* t, const int* ids, T* o, u64 tokens, u64 hidden,   \
                                                 u64 start, u64 len) {                                       \
        gather_k<T, int>(t, ids, o, tokens, hidden, start, len);                                             \
    }                                                                                                        \
    extern "C" __global__ void embedding_backward_##N(T* dt, const T* dy, const i64* starts,                 \
                                                      const i64* positions, u64 hidden, int accum) {         \
        scatter_k<T>(dt, dy, starts, positions, hidden, accum);                                              \
    }
FLOATS(EMB_ENTRIES)
