// The context-parallel (ring) attention pieces of ops::attention_block on the device:
// blockwise attention of a query block to a key/value block at arbitrary (strictly increasing)
// positions, its backward share, the lse merge of partial results, the fused QKV gradient from
// its parts, and the row gather context parallelism reorders tokens with. Same approach as
// attention.cu: one block per (head, sample, row), the row's scores in dynamic shared memory
// (the host bounds the block lengths by it).
//
// Layouts (d the head dim, K KV heads each shared by g query heads, H = K*g, B samples, nq / nk
// query / key rows per sample):
//   qkv [B*nq, K*(g+2)*d] (KV group j at j*(g+2)*d: g query heads, k, v), kv [B*nk, K*2d] (KV head
//   j: k at j*2d, v at j*2d + d); out [B*nq, H*d] and lse [B*nq, H] in the compute type;
//   dq [B*nq, H*d], dkv as kv, compute type.
//   Loaded operands: q [H, B, nq, d] (times the score scale), k, v [K, B, nk, d]; query head h
//   reads KV head h / g. q and k come in already rotated (the caller's RoPE). qpos [nq],
//   kpos [nk]: i64 positions (for the mask).
// qfirst [B*nq]: i64, each query row's first visible key position (ops::AttentionMask: its
// document's start or the window's, 0 for plain causal attention), never decreasing along a
// sample. Query i sees key j when qfirst[b*nq + i] <= kpos[j] <= qpos[i]: with increasing
// positions the visible keys are a contiguous run (count_lt .. count_le), and the queries that see
// key j are too (those from count_lt(qpos, kpos[j]) on, before count_le(qfirst, kpos[j])). The
// loops visit exactly those keys and queries: masked ones are skipped, never computed (the host's
// tile rule ops::key_tile_masked on a tile of one row), and a block no query sees is not launched.

template <class A> __device__ __forceinline__ A* blk_smem() {
    extern __shared__ double blk_smem_d[];  // double: 8-byte aligned for both compute types
    return reinterpret_cast<A*>(blk_smem_d);
}

// How many of the increasing pos[0..n] are <= x.
__device__ __forceinline__ u64 count_le(const i64* pos, u64 n, i64 x) {
    u64 lo = 0, hi = n;
    while (lo < hi) {
        u64 mid = lo + (hi - lo) / 2;
        if (pos[mid] <= x) lo = mid + 1; else hi = mid;
    }
    return lo;
}
// How many of the increasing pos[0..n] are < x.
__device__ __forceinline__ u64 count_lt(const i64* pos, u64 n, i64 x) {
    u64 lo = 0, hi = n;
    while (lo < hi) {
        u64 mid = lo + (hi - lo) / 2;
        if (pos[mid] < x) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// q[h, b, i, :] = qkv[b*nq + i, (h/g)*(g+2)*d + (h%g)*d ..] * scale.
template <class T>
__device__ void blk_load_q_k(const T* qkv, typename Tr<T>::A* q, u64 batch, u64 kv_heads, u64 g, u64 nq, u64 d,
                             typename Tr<T>::A scale) {
    u64 cols = kv_heads * (g + 2) * d;
    GRID_STRIDE(o, kv_heads * g * batch * nq * d) {
        u64 c = o % d, i = (o / d) % nq, b = (o / (d * nq)) % batch, h = o / (d * nq * batch);
        q[o] = Tr<T>::to(qkv[(b * nq + i) * cols + (h / g) * (g + 2) * d + (h % g) * d + c]) * scale;
    }
}

// k[h, b, j, :] = kv[b*nk + j, h*2d ..], v[h, b, j, :] = kv[b*nk + j, h*2d + d ..].
template <class T>
__device__ void blk_load_kv_k(const T* kv, typename Tr<T>::A* k, typename Tr<T>::A* v, u64 batch, u64 heads, u64 nk,
                              u64 d) {
    typedef typename Tr<T>::A A;
    GRID_STRIDE(o, heads * batch * nk * d) {
        u64 c = o % d, j = (o / d) % nk, b = (o / (d * nk)) % batch, h = o / (d * nk * batch);
        const T* src = kv + (b * nk + j) * heads * 2 * d + h * 2 * d;
        k[o] = Tr<T>::to(src[c]) * (A)1;
        v[o] = Tr<T>::to(src[d + c]) * (A)1;
    }
}

// A fully masked block: out = 0, lse = -inf everywhere.
template <class A> __device__ void blk_masked_k(A* out, A* lse, u64 rows, u64 heads, u64 d) {
    GRID_STRIDE(i, rows * heads * d) out[i] = (A)0;
    GRID_STRIDE(i, rows * heads) lse[i] = neg_inf<A>();
}

// Forward of query row (h, b, i): normalized out and lse over the visible keys; a row that sees
// none gets out = 0, lse = -inf. Shared memory: nk scores.
template <class A>
__device__ void blk_fwd_k(const A* q, const A* k, const A* v, const i64* qpos, const i64* kpos, const i64* qfirst,
                          A* out, A* lse, u64 batch, u64 heads, u64 g, u64 nq, u64 nk, u64 d) {
    A* e = blk_smem<A>();
    u64 row = blockIdx.x;
    u64 i = row % nq, b = (row / nq) % batch, h = row / (nq * batch);
    u64 t = b * nq + i;
    A* o = out + t * heads * d + h * d;
    // The visible keys j0 .. live - 1: the same in every thread of the block.
    u64 j0 = count_lt(kpos, nk, qfirst[t]), live = count_le(kpos, nk, qpos[i]);
    if (live <= j0) {
        for (u64 c = threadIdx.x; c < d; c += blockDim.x) o[c] = (A)0;
        if (threadIdx.x == 0) lse[t * heads + h] = neg_inf<A>();
        return;
    }
    const A* qi = q + ((h * batch + b) * nq + i) * d;
    const A* kb = k + ((h / g) * batch + b) * nk * d;
    const A* vb = v + ((h / g) * batch + b) * nk * d;
    A m = neg_inf<A>();
    for (u64 j = j0 + threadIdx.x; j < live; j += blockDim.x) {
        A sc = row_dot(qi, kb + j * d, d);
        e[j] = sc;
        if (sc > m) m = sc;
    }
    m = block_max(m);
    A l = 0;
    for (u64 j = j0 + threadIdx.x; j < live; j += blockDim.x) {
        A x = exp_fast(e[j] - m);
        e[j] = x;
        l += x;
    }
    l = block_sum(l);  // also a barrier: every e[j] is written
    for (u64 c = threadIdx.x; c < d; c += blockDim.x) {
        A acc = 0;
        for (u64 j = j0; j < live; ++j) acc += e[j] * vb[j * d + c];
        o[c] = acc / l;
    }
    if (threadIdx.x == 0) lse[t * heads + h] = m + lg(l);
}

// dq of query row (h, b, i), added into dq: D_i = dout_i . out_i (stored in dsum for the dkv
// kernel), dS_ij = P_ij (dout_i . v_j - D_i) with P_ij = exp(q_i . k_j - lse_i) over the visible
// keys, dq += scale * sum_j dS_ij k_j. Shared memory: nk values of dS.
template <class T>
__device__ void blk_bwd_dq_k(const typename Tr<T>::A* q, const typename Tr<T>::A* k, const typename Tr<T>::A* v,
                             const T* dout, const T* out, const typename Tr<T>::A* lse, const i64* qpos,
                             const i64* kpos, const i64* qfirst, typename Tr<T>::A* dsum, typename Tr<T>::A* dq, u64 batch, u64 heads,
                             u64 g, u64 nq, u64 nk, u64 d, typename Tr<T>::A scale) {
    typedef typename Tr<T>::A A;
    A* ds = blk_smem<A>();
    u64 row = blockIdx.x;
    u64 i = row % nq, b = (row / nq) % batch, h = row / (nq * batch);
    u64 t = b * nq + i;
    const T* go = dout + t * heads * d + h * d;
    const T* oo = out + t * heads * d + h * d;
    A part = 0;
    for (u64 c = threadIdx.x; c < d; c += blockDim.x) part += Tr<T>::to(go[c]) * Tr<T>::to(oo[c]);
    A D = block_sum(part);
    if (threadIdx.x == 0) dsum[(h * batch + b) * nq + i] = D;
    u64 j0 = count_lt(kpos, nk, qfirst[t]), live = count_le(kpos, nk, qpos[i]);
    if (live <= j0) return;  // uniform over the block
    A L = lse[t * heads + h];
    const A* qi = q + ((h * batch + b) * nq + i) * d;
    const A* kb = k + ((h / g) * batch + b) * nk * d;
    const A* vb = v + ((h / g) * batch + b) * nk * d;
    for (u64 j = j0 + threadIdx.x; j < live; j += blockDim.x) {
        A p = exp_fast(row_dot(qi, kb + j * d, d) - L);
        A dp = 0;
        const A* vj = vb + j * d;
        for (u64 c = 0; c < d; ++c) dp += Tr<T>::to(go[c]) * vj[c];
        ds[j] = p * (dp - D);
    }
    __syncthreads();
    A* dst = dq + t * heads * d + h * d;
    for (u64 c = threadIdx.x; c < d; c += blockDim.x) {
        A acc = 0;
        for (u64 j = j0; j < live; ++j) acc += ds[j] * kb[j * d + c];
        dst[c] += acc * scale;
    }
}

// Query head h's share of dk, dv of key row (b, j) of its KV head (after blk_bwd_dq, which
// stored D): over the queries that see key j (a run i0..i1), dv_j = sum_i P_ij dout_i,
// dk = sum_i dS_ij q_i (q already scaled), into dk/dv [H, B, nk, d] (blk_kv_add adds a group's
// shares into dkv). Shared memory: 2*nq values (P and dS).
template <class T>
__device__ void blk_bwd_dkv_k(const typename Tr<T>::A* q, const typename Tr<T>::A* k, const typename Tr<T>::A* v,
                              const T* dout, const typename Tr<T>::A* lse, const typename Tr<T>::A* dsum,
                              const i64* qpos, const i64* kpos, const i64* qfirst, typename Tr<T>::A* dk,
                              typename Tr<T>::A* dv,
                              u64 batch, u64 heads, u64 g, u64 nq, u64 nk, u64 d) {
    typedef typename Tr<T>::A A;
    A* P = blk_smem<A>();
    A* dS = P + nq;
    u64 row = blockIdx.x;
    u64 j = row % nk, b = (row / nk) % batch, h = row / (nk * batch);
    A* dkj = dk + ((h * batch + b) * nk + j) * d;
    A* dvj = dv + ((h * batch + b) * nk + j) * d;
    u64 i0 = count_lt(qpos, nq, kpos[j]);               // the first query that sees key j
    u64 i1 = count_le(qfirst + b * nq, nq, kpos[j]);    // past the last one
    if (i1 <= i0) {                                     // uniform over the block: no share
        for (u64 c = threadIdx.x; c < d; c += blockDim.x) dkj[c] = dvj[c] = (A)0;
        return;
    }
    const A* kj = k + (((h / g) * batch + b) * nk + j) * d;
    const A* vj = v + (((h / g) * batch + b) * nk + j) * d;
    const A* qb = q + (h * batch + b) * nq * d;
    for (u64 i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
        u64 t = b * nq + i;
        A p = exp_fast(row_dot(qb + i * d, kj, d) - lse[t * heads + h]);
        const T* go = dout + t * heads * d + h * d;
        A dp = 0;
        for (u64 c = 0; c < d; ++c) dp += Tr<T>::to(go[c]) * vj[c];
        P[i - i0] = p;
        dS[i - i0] = p * (dp - dsum[(h * batch + b) * nq + i]);
    }
    __syncthreads();
    for (u64 c = threadIdx.x; c < d; c += blockDim.x) {
        A acc = 0;
        for (u64 i = i0; i < i1; ++i) acc += P[i - i0] * Tr<T>::to(dout[(b * nq + i) * heads * d + h * d + c]);
        dvj[c] = acc;
    }
    for (u64 c = threadIdx.x; c < d; c += blockDim.x) {
        A acc = 0;
        for (u64 i = i0; i < i1; ++i) acc += dS[i - i0] * qb[i * d + c];
        dkj[c] = acc;
    }
}

// dkv[b*nk + j, kh*2d ..] += each of KV head kh's query heads' shares, in head order (as the CPU).
template <class A>
__device__ void blk_kv_add_k(const A* dk, const A* dv, A* dkv, u64 batch, u64 kv_heads, u64 g, u64 nk, u64 d) {
    u64 per_head = batch * nk * d;
    GRID_STRIDE(o, kv_heads * per_head) {
        u64 c = o % d, j = (o / d) % nk, b = (o / (d * nk)) % batch, kh = o / per_head;
        A* dst = dkv + (b * nk + j) * kv_heads * 2 * d + kh * 2 * d;
        u64 first = (kh * g) * per_head + o % per_head;
        for (u64 r = 0; r < g; ++r) {
            dst[c] += dk[first + r * per_head];
            dst[d + c] += dv[first + r * per_head];
        }
    }
}

// ops::merge_attention, one thread per (row, head): lse = log(e^la + e^lb) computed as
// m + log(e^(la-m) + e^(lb-m)), out = e^(la-lse) out_a + e^(lb-lse) out_b; a side with
// lse = -inf contributes nothing (the CPU's branches, in its order). fmax ignores a NaN operand
// as Rust's max does.
template <class A> __device__ __forceinline__ A mx(A a, A b);
template <> __device__ __forceinline__ float mx<float>(float a, float b) { return fmaxf(a, b); }
template <> __device__ __forceinline__ double mx<double>(double a, double b) { return fmax(a, b); }

template <class A> __device__ void merge_attention_k(A* oa, A* la, const A* ob, const A* lb, u64 n, u64 d) {
    GRID_STRIDE(r, n) {
        A b = lb[r];
        if (b == neg_inf<A>()) continue;
        A* x = oa + r * d;
        const A* y = ob + r * d;
        A a = la[r];
        if (a == neg_inf<A>()) {
            for (u64 c = 0; c < d; ++c) x[c] = y[c];
            la[r] = b;
            continue;
        }
        A m = mx(a, b);
        A l = m + lg(ex(a - m) + ex(b - m));
        A wa = ex(a - l), wb = ex(b - l);
        for (u64 c = 0; c < d; ++c) x[c] = wa * x[c] + wb * y[c];
        la[r] = l;
    }
}

// ops::fuse_qkv_grad: per row r and KV group j (rj = r*kv_heads + j), the group's g*d query
// columns round(dq[rj*g*d + c]), then its k and v round(dkv[rj*2d + c - g*d]).
template <class T>
__device__ void fuse_qkv_grad_k(const typename Tr<T>::A* dq, const typename Tr<T>::A* dkv, T* out, u64 rows,
                                u64 kv_heads, u64 g, u64 d) {
    u64 gq = g * d, gc = (g + 2) * d;
    GRID_STRIDE(o, rows * kv_heads * gc) {
        u64 c = o % gc, rj = o / gc;
        out[o] = Tr<T>::from(c < gq ? dq[rj * gq + c] : dkv[rj * 2 * d + c - gq]);
    }
}

// ops::gather_rows: out[i, :] = t[src[i], :] (bitwise; the host checked every index).
template <class T> __device__ void gather_rows_k(const T* t, const i64* src, T* out, u64 n, u64 cols) {
    GRID_STRIDE(o, n * cols) {
        u64 i = o / cols, c = o % cols;
        out[o] = t[(u64)src[i] * cols + c];
    }
}

#define BLK_ENTRIES(N, T)                                                                                          \
    extern "C" __global__ void attn_block_load_q_##N(const T* qkv, Tr<T>::A* q, u64 batch, u64 kv_heads, u64 g,    \
                                                     u64 nq, u64 d, Tr<T>::A scale) {                              \
        blk_load_q_k<T>(qkv, q, batch, kv_heads, g, nq, d, scale);                                                 \
    }                                                                                                              \
    extern "C" __global__ void attn_block_load_kv_##N(const T* kv, Tr<T>::A* k, Tr<T>::A* v, u64 batch, u64 heads, \
                                                      u64 nk, u64 d) {                                             \
        blk_load_kv_k<T>(kv, k, v, batch, heads, nk, d);                                                           \
    }                                                                                                              \
    extern "C" __global__ void attn_block_masked_##N(Tr<T>::A* out, Tr<T>::A* lse, u64 rows, u64 heads, u64 d) {   \
        blk_masked_k<Tr<T>::A>(out, lse, rows, heads, d);                                                          \
    }                                                                                                              \
    extern "C" __global__ void attn_block_forward_##N(const Tr<T>::A* q, const Tr<T>::A* k, const Tr<T>::A* v,     \
                                                      const i64* qpos, const i64* kpos, const i64* qfirst,         \
                                                      Tr<T>::A* out, Tr<T>::A* lse, u64 batch, u64 heads, u64 g,   \
                                                      u64 nq, u64 nk, u64 d) {                                     \
        blk_fwd_k<Tr<T>::A>(q, k, v, qpos, kpos, qfirst, out, lse, batch, heads, g, nq, nk, d);                    \
    }                                                                                                              \
    extern "C" __global__ void attn_block_backward_dq_##N(                                                         \
        const Tr<T>::A* q, const Tr<T>::A* k, const Tr<T>::A* v, const T* dout, const T* out, const Tr<T>::A* lse, \
        const i64* qpos, const i64* kpos, const i64* qfirst, Tr<T>::A* dsum, Tr<T>::A* dq, u64 batch, u64 heads,   \
        u64 g, u64 nq, u64 nk, u64 d, Tr<T>::A scale) {                                                            \
        blk_bwd_dq_k<T>(q, k, v, dout, out, lse, qpos, kpos, qfirst, dsum, dq, batch, heads, g, nq, nk, d, scale); \
    }                                                                                                              \
    extern "C" __global__ void attn_block_backward_dkv_##N(                                                        \
        const Tr<T>::A* q, const Tr<T>::A* k, const Tr<T>::A* v, const T* dout, const Tr<T>::A* lse,              \
        const Tr<T>::A* dsum, const i64* qpos, const i64* kpos, const i64* qfirst, Tr<T>::A* dk, Tr<T>::A* dv,     \
        u64 batch, u64 heads, u64 g, u64 nq, u64 nk, u64 d) {                                                      \
        blk_bwd_dkv_k<T>(q, k, v, dout, lse, dsum, qpos, kpos, qfirst, dk, dv, batch, heads, g, nq, nk, d);        \
    }                                                                                                              \
    extern "C" __global__ void attn_block_kv_add_##N(const Tr<T>::A* dk, const Tr<T>::A* dv, Tr<T>::A* dkv,        \
                                                     u64 batch, u64 kv_heads, u64 g, u64 nk, u64 d) {              \
        blk_kv_add_k<Tr<T>::A>(dk, dv, dkv, batch, kv_heads, g, nk, d);                                            \
    }                                                                                                              \
    extern "C" __global__ void fuse_qkv_grad_##N(const Tr<T>::A* dq, const Tr<T>::A* dkv, T* out, u64 rows,        \
                                                 u64 kv_heads, u64 g, u64 d) {                                     \
        fuse_qkv_grad_k<T>(dq, dkv, out, rows, kv_heads, g, d);                                                    \
    }
FLOATS(BLK_ENTRIES)

// merge_attention runs on the compute types only.
#define MERGE_ENTRIES(N, A)                                                                                        \
    extern "C" __global__ void merge_attention_##N(A* oa, A* la, const A* ob, const A* lb, u64 n, u64 d) {         \
        merge_attention_k<A>(oa, la, ob, lb, n, d);                                                                \
    }
MERGE_ENTRIES(f32, float)
MERGE_ENTRIES(f64, double)

#define GATHER_ENTRIES(N, T)                                                                                       \
    extern "C" __global__ void gather_rows_##N(const T* t, const i64* src, T* out, u64 n, u64 cols) {              \
        gather_rows_k<T>(t, src, out, n, cols);                                                                    \
    }
ALL_TYPES(GATHER_ENTRIES)
