// Rotary position embedding (ops::rope and its backward): x [tokens, heads*d], each head's
// first r columns rotated in pairs, the rest copied. One grid-stride thread per (token,
// head, pair) and per (token, head, tail column); nothing is shared between threads.
//
// cs/sn: [tokens, r/2] tables a*cos(pos*inv_freq[i]) and a*sin(...), computed on the host in
// f64 (Rope::tables) and rounded once into the compute type. `sign` is +1 for the rotation,
// -1 for its transpose (the gradient): sines times -1 are exact, so both directions share
// the CPU's expressions (cpu/rope.rs) operation for operation.
// Pairs: interleaved (2i, 2i+1), half-split (i, i + r/2). Heads come in runs of `group`; only
// the first `rotated` of each run turn (a fused QKV's q and k heads), the others are copied.

template <class T>
__device__ void rope_k(const T* x, T* y, const typename Tr<T>::A* cs, const typename Tr<T>::A* sn, u64 tokens,
                       u64 heads, u64 d, u64 r, int half_split, u64 group, u64 rotated,
                       typename Tr<T>::A sign) {
    typedef typename Tr<T>::A A;
    u64 half = r / 2, per_head = d - half;  // half pairs, then d - r tail columns
    GRID_STRIDE(o, tokens * heads * per_head) {
        u64 q = o % per_head, th = o / per_head, t = th / heads;
        u64 base = th * d;
        bool turns = (th % heads) % group < rotated;
        if (q < half && !turns) {
            u64 j0 = half_split ? q : 2 * q, j1 = half_split ? q + half : 2 * q + 1;
            y[base + j0] = x[base + j0];
            y[base + j1] = x[base + j1];
        } else if (q < half) {
            u64 j0 = half_split ? q : 2 * q, j1 = half_split ? q + half : 2 * q + 1;
            A c = cs[t * half + q], s = sign * sn[t * half + q];
            A a = Tr<T>::to(x[base + j0]), b = Tr<T>::to(x[base + j1]);
            y[base + j0] = Tr<T>::from(a * c - b * s);
            y[base + j1] = Tr<T>::from(a * s + b * c);
        } else {
            u64 j = r + (q - half);
            y[base + j] = x[base + j];
        }
    }
}

#define ROPE_ENTRIES(N, T)                                                                                  \
    extern "C" __global__ void rope_##N(const T* x, T* y, const Tr<T>::A* cs, const Tr<T>::A* sn, u64 tokens, \
                                        u64 heads, u64 d, u64 r, int half_split, u64 group, u64 rotated,     \
                                        Tr<T>::A sign) {                                                      \
        rope_k<T>(x, y, cs, sn, tokens, heads, d, r, half_split, group, rotated, sign);                     \
    }
FLOATS(ROPE_ENTRIES)
