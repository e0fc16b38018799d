// Causal self-attention on a fused QKV (q and k already rotated by the caller) (ops::causal_attention and its backward):
// a straightforward kernel, one block per (head, sample, row), scores for the row kept in
// dynamic shared memory (so seq_len is bounded by it; the host checks). Not tiled like
// FlashAttention: O(s^2 d) work per head with k/v read from global memory per row.
//
// Layouts (d the head dim, s the sequence length, K KV heads each shared by g query heads,
// H = K*g query heads, B samples, tokens = B*s):
//   qkv [tokens, K*(g+2)*d] (KV group j at j*(g+2)*d: its g query heads, then k, then v),
//   out [tokens, H*d], lse [tokens, H] (compute type). The loaded operands are q [H, B, s, d]
//   (times the score scale) and k, v [K, B, s, d] in the compute type (attn_load_q/_kv);
//   query head h reads KV head h / g.
// Block index: ((h*B + b)*s + i); ROW_THREADS threads.
//
// Masks (ops::AttentionMask): first [B*s] (i64) holds each token's first visible key position
// (its document's start or i + 1 - window, whichever is later; 0 for plain causal attention),
// never decreasing along a sample. Query i sees keys first[b*s + i] ..= i and nothing else: the
// loops below visit exactly those keys, so masked keys are skipped, never computed (the host's
// tile rule ops::key_tile_masked on a tile of one query). Key j is seen by queries j .. i1 - 1,
// i1 the number of queries whose first visible key is <= j (a prefix, as first never decreases).

template <class A> __device__ __forceinline__ A* dyn_smem() {
    extern __shared__ double smem_d[];  // double: 8-byte aligned for both compute types
    return reinterpret_cast<A*>(smem_d);
}

// How many of the non-decreasing xs[0..n] are <= x.
__device__ __forceinline__ u64 attn_count_le(const i64* xs, u64 n, i64 x) {
    u64 lo = 0, hi = n;
    while (lo < hi) {
        u64 mid = lo + (hi - lo) / 2;
        if (xs[mid] <= x) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// Column of query head h (of g per KV group) in a qkv row, and of KV head j's k.
__device__ __forceinline__ u64 q_col(u64 h, u64 g, u64 d) { return (h / g) * (g + 2) * d + (h % g) * d; }
__device__ __forceinline__ u64 k_col(u64 j, u64 g, u64 d) { return (j * (g + 2) + g) * d; }

// q[h, b, i, c] = qkv[b*s + i, q_col(h) + c] * scale (as the CPU's Qkv::load_q).
template <class T>
__device__ void attn_load_q_k(const T* qkv, typename Tr<T>::A* q, u64 batch, u64 kv_heads, u64 g, u64 s, u64 d,
                              typename Tr<T>::A scale) {
    u64 cols = kv_heads * (g + 2) * d;
    GRID_STRIDE(o, kv_heads * g * batch * s * d) {
        u64 c = o % d, i = (o / d) % s, b = (o / (d * s)) % batch, h = o / (d * s * batch);
        q[o] = Tr<T>::to(qkv[(b * s + i) * cols + q_col(h, g, d) + c]) * scale;
    }
}

// k/v[j, b, i, c] from KV head j's columns (as the CPU's Qkv::load_kv).
template <class T>
__device__ void attn_load_kv_k(const T* qkv, typename Tr<T>::A* k, typename Tr<T>::A* v, u64 batch, u64 kv_heads,
                               u64 g, u64 s, u64 d) {
    typedef typename Tr<T>::A A;
    u64 cols = kv_heads * (g + 2) * d;
    GRID_STRIDE(o, kv_heads * batch * s * d) {
        u64 c = o % d, i = (o / d) % s, b = (o / (d * s)) % batch, j = o / (d * s * batch);
        const T* src = qkv + (b * s + i) * cols + k_col(j, g, d);
        k[o] = Tr<T>::to(src[c]) * (A)1;
        v[o] = Tr<T>::to(src[d + c]) * (A)1;
    }
}

// Shared memory: s scores.
template <class T>
__device__ void attn_fwd_k(const typename Tr<T>::A* q, const typename Tr<T>::A* k, const typename Tr<T>::A* v,
                           const i64* first, T* out, typename Tr<T>::A* lse, u64 batch, u64 heads, u64 g, u64 s,
                           u64 d) {
    typedef typename Tr<T>::A A;
    A* e = dyn_smem<A>();
    u64 row = blockIdx.x;
    u64 i = row % s, b = (row / s) % batch, h = row / (s * batch);
    u64 base = (h * batch + b) * s;          // row 0 of this (query head, sample)
    u64 kbase = ((h / g) * batch + b) * s;   // row 0 of its KV head's sample
    const A* qi = q + (base + i) * d;
    u64 j0 = (u64)first[b * s + i];
    A m = neg_inf<A>();
    for (u64 j = j0 + threadIdx.x; j <= i; j += blockDim.x) {
        A sc = row_dot(qi, k + (kbase + j) * d, d);
        e[j] = sc;
        if (sc > m) m = sc;
    }
    m = block_max(m);
    A l = 0;
    for (u64 j = j0 + threadIdx.x; j <= i; j += blockDim.x) {
        A x = exp_fast(e[j] - m);
        e[j] = x;
        l += x;
    }
    l = block_sum(l);  // also a barrier: every e[j] is written
    u64 t = b * s + i;
    for (u64 c = threadIdx.x; c < d; c += blockDim.x) {
        A acc = 0;
        for (u64 j = j0; j <= i; ++j) acc += e[j] * v[(kbase + j) * d + c];
        out[t * heads * d + h * d + c] = Tr<T>::from(acc / l);
    }
    if (threadIdx.x == 0) lse[t * heads + h] = m + lg(l);
}

// dq for row i: D_i = dout_i.out_i (also stored for attn_bwd_dkv), dS_ij = P_ij (dout_i.v_j - D_i)
// with P_ij = exp(q_i.k_j - lse_i), dq = scale * sum_j dS_ij k_j. Shared memory: s values of dS.
template <class T>
__device__ void attn_bwd_dq_k(const typename Tr<T>::A* q, const typename Tr<T>::A* k, const typename Tr<T>::A* v,
                              const T* dout, const T* out, const typename Tr<T>::A* lse, const i64* first,
                              typename Tr<T>::A* dsum, T* dqkv, u64 batch, u64 heads, u64 g, u64 s, u64 d,
                              typename Tr<T>::A scale) {
    typedef typename Tr<T>::A A;
    A* ds = dyn_smem<A>();
    u64 row = blockIdx.x;
    u64 i = row % s, b = (row / s) % batch, h = row / (s * batch);
    u64 base = (h * batch + b) * s;
    u64 kbase = ((h / g) * batch + b) * s;
    u64 t = b * s + i;
    const T* go = dout + t * heads * d + h * d;
    const T* oo = out + t * heads * d + h * d;
    A part = 0;
    for (u64 c = threadIdx.x; c < d; c += blockDim.x) part += Tr<T>::to(go[c]) * Tr<T>::to(oo[c]);
    A D = block_sum(part);
    if (threadIdx.x == 0) dsum[base + i] = D;
    A L = lse[t * heads + h];
    const A* qi = q + (base + i) * d;
    u64 j0 = (u64)first[t];
    for (u64 j = j0 + threadIdx.x; j <= i; j += blockDim.x) {
        A p = exp_fast(row_dot(qi, k + (kbase + j) * d, d) - L);
        A dp = 0;
        const A* vj = v + (kbase + j) * d;
        for (u64 c = 0; c < d; ++c) dp += Tr<T>::to(go[c]) * vj[c];
        ds[j] = p * (dp - D);
    }
    __syncthreads();
    T* dst = dqkv + t * (heads / g) * (g + 2) * d + q_col(h, g, d);
    for (u64 c = threadIdx.x; c < d; c += blockDim.x) {
        A acc = 0;
        for (u64 j = j0; j <= i; ++j) acc += ds[j] * k[(kbase + j) * d + c];
        dst[c] = Tr<T>::from(acc * scale);
    }
}

// Query head h's share of dk, dv for key row j of its KV head (after attn_bwd_dq, which stored
// D): over the queries i = j .. i1 - 1 that see key j, dv_j = sum_i P_ij dout_i, dk = sum_i dS_ij q_i (q already scaled),
// into dk/dv [H, B, s, d] (attn_bwd_kv_sum adds a group's shares). Shared memory: 2*s values
// (P and dS).
template <class T>
__device__ void attn_bwd_dkv_k(const typename Tr<T>::A* q, const typename Tr<T>::A* k, const typename Tr<T>::A* v,
                               const T* dout, const typename Tr<T>::A* lse, const typename Tr<T>::A* dsum,
                               const i64* first, typename Tr<T>::A* dk, typename Tr<T>::A* dv, u64 batch, u64 heads,
                               u64 g, u64 s, u64 d) {
    typedef typename Tr<T>::A A;
    A* P = dyn_smem<A>();
    A* dS = P + s;
    u64 row = blockIdx.x;
    u64 j = row % s, b = (row / s) % batch, h = row / (s * batch);
    u64 base = (h * batch + b) * s;
    u64 kbase = ((h / g) * batch + b) * s;
    const A* kj = k + (kbase + j) * d;
    const A* vj = v + (kbase + j) * d;
    u64 i1 = attn_count_le(first + b * s, s, (i64)j);  // the same in every thread of the block
    for (u64 i = j + threadIdx.x; i < i1; i += blockDim.x) {
        u64 t = b * s + i;
        A p = exp_fast(row_dot(q + (base + i) * d, kj, d) - lse[t * heads + h]);
        const T* go = dout + t * heads * d + h * d;
        A dp = 0;
        for (u64 c = 0; c < d; ++c) dp += Tr<T>::to(go[c]) * vj[c];
        P[i - j] = p;
        dS[i - j] = p * (dp - dsum[base + i]);
    }
    __syncthreads();
    for (u64 c = threadIdx.x; c < d; c += blockDim.x) {
        A acc = 0;
        for (u64 i = j; i < i1; ++i) acc += P[i - j] * Tr<T>::to(dout[(b * s + i) * heads * d + h * d + c]);
        dv[(base + j) * d + c] = acc;
    }
    for (u64 c = threadIdx.x; c < d; c += blockDim.x) {
        A acc = 0;
        for (u64 i = j; i < i1; ++i) acc += dS[i - j] * q[(base + i) * d + c];
        dk[(base + j) * d + c] = acc;
    }
}

// KV head j's dk, dv: its g query heads' shares summed in head order (as the CPU), rounded
// once into dqkv's k and v columns.
template <class T>
__device__ void attn_bwd_kv_sum_k(const typename Tr<T>::A* dk, const typename Tr<T>::A* dv, T* dqkv, u64 batch,
                                  u64 kv_heads, u64 g, u64 s, u64 d) {
    typedef typename Tr<T>::A A;
    u64 cols = kv_heads * (g + 2) * d, per_head = batch * s * d;
    GRID_STRIDE(o, kv_heads * per_head) {
        u64 c = o % d, i = (o / d) % s, b = (o / (d * s)) % batch, j = o / per_head;
        u64 first = (j * g) * per_head + o % per_head;
        A sk = dk[first], sv = dv[first];
        for (u64 r = 1; r < g; ++r) {
            sk += dk[first + r * per_head];
            sv += dv[first + r * per_head];
        }
        T* dst = dqkv + (b * s + i) * cols + k_col(j, g, d);
        dst[c] = Tr<T>::from(sk);
        dst[d + c] = Tr<T>::from(sv);
    }
}

#define ATTN_ENTRIES(N, T)                                                                                       \
    extern "C" __global__ void attn_load_q_##N(const T* qkv, Tr<T>::A* q, u64 batch, u64 kv_heads, u64 g, u64 s, \
                                               u64 d, Tr<T>::A scale) {                                          \
        attn_load_q_k<T>(qkv, q, batch, kv_heads, g, s, d, scale);                                               \
    }                                                                                                            \
    extern "C" __global__ void attn_load_kv_##N(const T* qkv, Tr<T>::A* k, Tr<T>::A* v, u64 batch, u64 kv_heads, \
                                                u64 g, u64 s, u64 d) {                                           \
        attn_load_kv_k<T>(qkv, k, v, batch, kv_heads, g, s, d);                                                  \
    }                                                                                                            \
    extern "C" __global__ void attn_forward_##N(const Tr<T>::A* q, const Tr<T>::A* k, const Tr<T>::A* v,         \
                                                const i64* first, T* out, Tr<T>::A* lse, u64 batch, u64 heads,   \
                                                u64 g, u64 s, u64 d) {                                           \
        attn_fwd_k<T>(q, k, v, first, out, lse, batch, heads, g, s, d);                                          \
    }                                                                                                            \
    extern "C" __global__ void attn_backward_dq_##N(const Tr<T>::A* q, const Tr<T>::A* k, const Tr<T>::A* v,     \
                                                    const T* dout, const T* out, const Tr<T>::A* lse,            \
                                                    const i64* first, Tr<T>::A* dsum, T* dqkv, u64 batch,        \
                                                    u64 heads, u64 g, u64 s, u64 d, Tr<T>::A scale) {            \
        attn_bwd_dq_k<T>(q, k, v, dout, out, lse, first, dsum, dqkv, batch, heads, g, s, d, scale);              \
    }                                                                                                            \
    extern "C" __global__ void attn_backward_dkv_##N(const Tr<T>::A* q, const Tr<T>::A* k, const Tr<T>::A* v,    \
                                                     const T* dout, const Tr<T>::A* lse, const Tr<T>::A* dsum,   \
                                                     const i64* first, Tr<T>::A* dk, Tr<T>::A* dv, u64 batch,    \
                                                     u64 heads, u64 g, u64 s, u64 d) {                           \
        attn_bwd_dkv_k<T>(q, k, v, dout, lse, dsum, first, dk, dv, batch, heads, g, s, d);                       \
    }                                                                                                            \
    extern "C" __global__ void attn_backward_kv_sum_##N(const Tr<T>::A* dk, const Tr<T>::A* dv, T* dqkv,         \
                                                        u64 batch, u64 kv_heads, u64 g, u64 s, u64 d) {          \
        attn_bwd_kv_sum_k<T>(dk, dv, dqkv, batch, kv_heads, g, s, d);                                            \
    }
FLOATS(ATTN_ENTRIES)
