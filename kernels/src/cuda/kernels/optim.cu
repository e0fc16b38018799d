// AdamW, one grid-stride thread per element: nn's host `adamw_step` with the same formula
// and order of operations (no FMA: --fmad=false), so f32 and f64 match the host bit for bit:
//   m <- b1*m + (1-b1)*g;  v <- b2*v + (1-b2)*g*g;
//   w <- w - lr*((m/c1)/(sqrt(v/c2) + eps) + decay*w).
// S is the moments' type and the arithmetic: float for f32, double for f64 and for the
// 16-bit types (whose host step widens w and g to f64 and rounds w back once).
template <class T> struct AdamS { typedef double S; };
template <> struct AdamS<float> { typedef float S; };

template <class T>
__device__ void adamw_k(T* w, const T* g, typename AdamS<T>::S* m, typename AdamS<T>::S* v, double lr,
                        double beta1, double beta2, double eps, double decay, double c1, double c2, u64 n) {
    typedef typename AdamS<T>::S S;
    // The hyperparameters rounded into S once, as the host's `T::from(x)`.
    const S b1 = (S)beta1, b2 = (S)beta2, one = (S)1.0;
    const S k1 = (S)c1, k2 = (S)c2, e = (S)eps, l = (S)lr, d = (S)decay;
    GRID_STRIDE(i, n) {
        const S gi = (S)Tr<T>::to(g[i]);
        const S mi = b1 * m[i] + (one - b1) * gi;
        const S vi = b2 * v[i] + (one - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        const S upd = (mi / k1) / (sq(vi / k2) + e);
        const S wi = (S)Tr<T>::to(w[i]);
        w[i] = cast_from_f64<T>((double)(wi - l * (upd + d * wi)));
    }
}

#define ADAMW(N, T)                                                                                        \
    extern "C" __global__ void adamw_##N(T* w, const T* g, AdamS<T>::S* m, AdamS<T>::S* v, double lr,     \
                                         double b1, double b2, double eps, double decay, double c1,       \
                                         double c2, u64 n) {                                              \
        adamw_k<T>(w, g, m, v, lr, b1, b2, eps, decay, c1, c2, n);                                         \
    }
FLOATS(ADAMW)
