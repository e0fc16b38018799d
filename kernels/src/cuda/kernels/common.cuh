// Shared by every kernel module (prepended to each source before NVRTC compiles it).
//
// No headers: NVRTC has no built-in cuda_fp16.h / cuda_bf16.h, and the GPU machine's headers
// may not be where we look, so the 16-bit types are plain structs over their bits with
// hand-written conversions that round exactly like the `half` crate on the CPU:
// - bf16 -> f32 is exact (the bits shifted up); f32 -> bf16 is half's round-to-nearest-even
//   with NaN kept quiet (`(bits >> 16) | 0x40`).
// - f16 <-> f32 use PTX `cvt` (IEEE round-to-nearest-even), as half does.
// Compiled with --fmad=false: a*b+c is never fused, so plain mul/add round like the CPU.

typedef unsigned long long u64;
typedef long long i64;

struct bf16 { unsigned short x; };
struct f16 { unsigned short x; };

__device__ __forceinline__ float bf16_to_f32(bf16 v) { return __uint_as_float(((unsigned)v.x) << 16); }
__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    unsigned x = __float_as_uint(f);
    bf16 r;
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) { r.x = (unsigned short)((x >> 16) | 0x0040u); return r; }
    const unsigned round_bit = 0x00008000u;
    unsigned h = x >> 16;
    if ((x & round_bit) != 0 && (x & (3u * round_bit - 1u)) != 0) h += 1;
    r.x = (unsigned short)h;
    return r;
}
__device__ __forceinline__ float f16_to_f32(f16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
    return f;
}
__device__ __forceinline__ f16 f32_to_f16(float f) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.x) : "f"(f));
    return r;
}

// Element traits: A is the compute type (f32 for f32/bf16/f16, f64 for f64), `to` widens
// exactly, `from` rounds once.
template <class T> struct Tr;
template <> struct Tr<float> {
    typedef float A;
    static __device__ __forceinline__ float to(float v) { return v; }
    static __device__ __forceinline__ float from(float v) { return v; }
};
template <> struct Tr<double> {
    typedef double A;
    static __device__ __forceinline__ double to(double v) { return v; }
    static __device__ __forceinline__ double from(double v) { return v; }
};
template <> struct Tr<bf16> {
    typedef float A;
    static __device__ __forceinline__ float to(bf16 v) { return bf16_to_f32(v); }
    static __device__ __forceinline__ bf16 from(float v) { return f32_to_bf16(v); }
};
template <> struct Tr<f16> {
    typedef float A;
    static __device__ __forceinline__ float to(f16 v) { return f16_to_f32(v); }
    static __device__ __forceinline__ f16 from(float v) { return f32_to_f16(v); }
};
template <> struct Tr<int> {
    typedef int A;
    static __device__ __forceinline__ int to(int v) { return v; }
    static __device__ __forceinline__ int from(int v) { return v; }
};
template <> struct Tr<i64> {
    typedef i64 A;
    static __device__ __forceinline__ i64 to(i64 v) { return v; }
    static __device__ __forceinline__ i64 from(i64 v) { return v; }
};

// What the CPU kernels' `store(d, v, accum)` does: accum 0 replaces, 1 adds (rounding once).
template <class T>
__device__ __forceinline__ void store(T* d, typename Tr<T>::A v, int accum) {
    *d = accum ? Tr<T>::from(Tr<T>::to(*d) + v) : Tr<T>::from(v);
}

// a . b over d elements, summed in order (the CPU's dot in the attention kernels).
template <class A> __device__ __forceinline__ A row_dot(const A* a, const A* b, u64 d) {
    A acc = 0;
    for (u64 c = 0; c < d; ++c) acc += a[c] * b[c];
    return acc;
}

// The CPU's `exp_f32` (kernels/src/ops/mod.rs), operation for operation: Cephes' expf,
// clamped to [-87.34, 88], NaN passes through. With --fmad=false it gives the same bits.
__device__ __forceinline__ float exp_fast(float x) {
    const float HI = 88.0f;
    const float LO = -87.33654f;
    const float MAGIC = 12582912.0f;
    x = x > HI ? HI : x;
    x = x < LO ? LO : x;
    float t = x * 1.44269504088896340736f + MAGIC;
    float n = t - MAGIC;
    float r = x - n * 0.6933594f - n * -2.1219444e-4f;
    float p = 1.9875691e-4f;
    p = p * r + 1.3982e-3f;
    p = p * r + 8.333452e-3f;
    p = p * r + 4.1665796e-2f;
    p = p * r + 1.6666665e-1f;
    p = p * r + 0.5f;
    float y = p * (r * r) + r + 1.0f;
    float pow2 = __uint_as_float((__float_as_uint(t) - (0x4B400000u - 127u)) << 23);
    return y * pow2;
}
__device__ __forceinline__ double exp_fast(double x) { return exp(x); }

__device__ __forceinline__ bool is_nan(float v) { return v != v; }
__device__ __forceinline__ bool is_nan(double v) { return v != v; }

template <class A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() { return __longlong_as_double(0xfff0000000000000ll); }
template <class A> __device__ __forceinline__ A qnan();
template <> __device__ __forceinline__ float qnan<float>() { return __int_as_float(0x7fc00000); }
template <> __device__ __forceinline__ double qnan<double>() { return __longlong_as_double(0x7ff8000000000000ll); }

// Row kernels run one block of ROW_THREADS threads per row; the block reductions below are
// a fixed tree over the threads, so a result does not change from run to run.
#define ROW_THREADS 256

// Sum over the block (blockDim.x == ROW_THREADS), every thread gets the result.
template <class A>
__device__ A block_sum(A v) {
    __shared__ A sh[ROW_THREADS];
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = ROW_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    A r = sh[0];
    __syncthreads();
    return r;
}

// Max over the block; NaN never wins here (callers track NaN separately, as the CPU does).
template <class A>
__device__ A block_max(A v) {
    __shared__ A sh[ROW_THREADS];
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = ROW_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            A o = sh[threadIdx.x + s];
            if (o > sh[threadIdx.x]) sh[threadIdx.x] = o;
        }
        __syncthreads();
    }
    A r = sh[0];
    __syncthreads();
    return r;
}

#define GRID_STRIDE(i, n) for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

#define FLOATS(X) X(f32, float) X(f64, double) X(bf16, bf16) X(f16, f16)
#define ALL_TYPES(X) FLOATS(X) X(i32, int) X(i64, i64)

// The standard exp/log/sqrt in the compute type (CUDA's: exp/log within 1-2 ulp, sqrt and
// division correctly rounded: NVRTC's defaults --prec-sqrt=true --prec-div=true).
__device__ __forceinline__ float ex(float v) { return expf(v); }
__device__ __forceinline__ double ex(double v) { return exp(v); }
__device__ __forceinline__ float lg(float v) { return logf(v); }
__device__ __forceinline__ double lg(double v) { return log(v); }
__device__ __forceinline__ float sq(float v) { return sqrtf(v); }
__device__ __forceinline__ double sq(double v) { return sqrt(v); }

// Casts, as Tensor::to_dtype: through f64 (exact for every source type but i64 beyond 2^53,
// which rounds there exactly as the CPU rounds it), then rounded once
// into the destination the way `half`/Rust `as` do it:
// - f32: round to nearest even (`as f32`).
// - bf16: half's f64_to_bf16, ported bit for bit (it drops the low 32 bits of the f64
//   mantissa before rounding, so it is not always correctly rounded; the CPU does the same).
// - f16: via f32 (what half does on x86 with f16c); half's software fallback (no f16c)
//   can differ by one ulp at rounding ties.
// - i32/i64: truncate toward zero, saturate, NaN -> 0 (Rust `as`; PTX cvt.rzi does exactly that).
__device__ __forceinline__ double cast_in(float v) { return (double)v; }
__device__ __forceinline__ double cast_in(double v) { return v; }
__device__ __forceinline__ double cast_in(bf16 v) { return (double)bf16_to_f32(v); }
__device__ __forceinline__ double cast_in(f16 v) { return (double)f16_to_f32(v); }
__device__ __forceinline__ double cast_in(int v) { return (double)v; }
__device__ __forceinline__ double cast_in(i64 v) { return (double)v; }

__device__ __forceinline__ bf16 f64_to_bf16(double value) {
    unsigned long long val = (unsigned long long)__double_as_longlong(value);
    unsigned x = (unsigned)(val >> 32);
    unsigned sign = x & 0x80000000u;
    unsigned exp = x & 0x7FF00000u;
    unsigned man = x & 0x000FFFFFu;
    bf16 r;
    if (exp == 0x7FF00000u) {
        unsigned nan_bit = (man == 0 && (unsigned)val == 0) ? 0u : 0x0040u;
        r.x = (unsigned short)((sign >> 16) | 0x7F80u | nan_bit | (man >> 13));
        return r;
    }
    unsigned half_sign = sign >> 16;
    i64 unbiased_exp = (i64)(exp >> 20) - 1023;
    i64 half_exp = unbiased_exp + 127;
    if (half_exp >= 0xFF) { r.x = (unsigned short)(half_sign | 0x7F80u); return r; }
    if (half_exp <= 0) {
        if (7 - half_exp > 21) { r.x = (unsigned short)half_sign; return r; }
        unsigned m = man | 0x00100000u;
        unsigned half_man = m >> (14 - half_exp);
        unsigned round_bit = 1u << (13 - half_exp);
        if ((m & round_bit) != 0 && (m & (3u * round_bit - 1u)) != 0) half_man += 1;
        r.x = (unsigned short)(half_sign | half_man);
        return r;
    }
    unsigned half_exp_u = ((unsigned)half_exp) << 7;
    unsigned half_man = man >> 13;
    unsigned round_bit = 0x00001000u;
    if ((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0) {
        r.x = (unsigned short)((half_sign | half_exp_u | half_man) + 1u);
    } else {
        r.x = (unsigned short)(half_sign | half_exp_u | half_man);
    }
    return r;
}

template <class T> __device__ __forceinline__ T cast_from_f64(double v);
template <> __device__ __forceinline__ float cast_from_f64<float>(double v) { return (float)v; }
template <> __device__ __forceinline__ double cast_from_f64<double>(double v) { return v; }
template <> __device__ __forceinline__ bf16 cast_from_f64<bf16>(double v) { return f64_to_bf16(v); }
template <> __device__ __forceinline__ f16 cast_from_f64<f16>(double v) { return f32_to_f16((float)v); }
template <> __device__ __forceinline__ int cast_from_f64<int>(double v) {
    int r;
    asm("cvt.rzi.s32.f64 %0, %1;" : "=r"(r) : "d"(v));
    return r;
}
template <> __device__ __forceinline__ i64 cast_from_f64<i64>(double v) {
    i64 r;
    asm("cvt.rzi.s64.f64 %0, %1;" : "=l"(r) : "d"(v));
    return r;
}

