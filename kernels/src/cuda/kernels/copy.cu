// Strided block copy, the data movement around collectives (Tensor::pack, Tensor::unpack,
// narrow, cat, write_at): `blocks` runs of `run` elements, run b read at
// src[src_off + b*src_stride ..] and written at dst[dst_off + b*dst_stride ..]. A bit copy,
// so every dtype moves bitwise. Pack of piece p along dim d of [outer, extent, inner] is
// blocks = outer, run = len_p*inner, src_stride = extent*inner, src_off = start_p*inner,
// dst_stride = run, dst_off = the pieces before it; unpack swaps the two sides.
template <class T>
__device__ void copy_blocks_k(const T* src, T* dst, u64 blocks, u64 run, u64 src_stride, u64 src_off,
                              u64 dst_stride, u64 dst_off) {
    GRID_STRIDE(i, blocks * run) {
        u64 b = i / run, k = i % run;
        dst[dst_off + b * dst_stride + k] = src[src_off + b * src_stride + k];
    }
}

#define COPY_ENTRIES(N, T)                                                                              \
    extern "C" __global__ void copy_blocks_##N(const T* s, T* d, u64 blocks, u64 run, u64 src_stride,   \
                                               u64 src_off, u64 dst_stride, u64 dst_off) {              \
        copy_blocks_k<T>(s, d, blocks, run, src_stride, src_off, dst_stride, dst_off);                  \
    }
ALL_TYPES(COPY_ENTRIES)
