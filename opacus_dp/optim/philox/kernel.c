/* Gaussian noise from Philox4x32-10, written (or added) at memory speed: the native kernel of
 * opacus_dp.optim.philox (reference.py computes the same numbers with torch, bit for bit).
 *
 * Stream: element i of a stream keyed by (k0, k1, c2, c3) lies in tile T = i / 256, plane
 * j = (i % 256) / 64, lane b = i % 64. Block n = 64 T + b is Philox4x32-10 (Salmon, Moraes, Dror &
 * Shaw, SC'11) of the counter (n mod 2^32, n / 2^32, c2, c3) under the key (k0, k1): four words
 * (w0, w1, w2, w3). The pair (w0, w1) gives planes 0 and 1, (w2, w3) planes 2 and 3, by Box-Muller:
 *   u = (floor(w0 / 2) + 1/2) 2^-31 in (0, 1],  r = sqrt(-2 ln u),
 *   angle = q pi/2 + pi/4 + t,  q = w1 / 2^30,  t = (f - 1/2) pi/2,  f = ((w1 / 64) mod 2^24) 2^-24,
 *   z = (r cos(angle), r sin(angle)),
 * ln by the atanh series of the mantissa (to s^9), sin t and cos t by their Taylor series (to t^9,
 * t^10). Every operation is a correctly rounded float32 operation in a fixed order (compiled
 * with -ffp-contract=off), so every build of this file, and the torch reference, give the same bits.
 * out[i] = base[i] + z_i * std (or z_i * std without base), divided by divisor unless it is 1 (the
 * mean's division of a step folded into the noise pass: the same correctly rounded division). */
#include <stdint.h>
#include <string.h>

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u
/* Taylor coefficients of sin and cos, rounded to float32: -1/3!, 1/5!, -1/7!, 1/9!; -1/2!, ..., -1/10! */
#define SIN3 (-0x1.555556p-3f)
#define SIN5 0x1.111112p-7f
#define SIN7 (-0x1.a01a02p-13f)
#define SIN9 0x1.71de3ap-19f
#define COS2 (-0.5f)
#define COS4 0x1.555556p-5f
#define COS6 (-0x1.6c16c2p-10f)
#define COS8 0x1.a01a02p-16f
#define COS10 (-0x1.27e4fcp-22f)
#define LANES 64
#define TILE (4 * LANES)

static inline float as_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t as_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

#if defined(__AVX512F__) || defined(__AVX2__)
/* The rounds on x86 vector registers: each 32 x 32 -> 64-bit product by vpmuludq, of the even
 * lanes and of the odd lanes shifted down, its low and high words blended back into place, the
 * lane groups interleaved so that their products overlap. Compilers turn the portable form below
 * into 64-bit multiplies (AVX-512) or slower code (AVX2): this form takes 0.6 (AVX-512) and 0.4
 * (AVX2) of their time. The same integer operations, hence the same bits. */
#include <immintrin.h>
#if defined(__AVX512F__)
typedef __m512i words;
#define WIDTH 16
#define LOAD(p) _mm512_loadu_si512(p)
#define STORE(p, v) _mm512_storeu_si512(p, v)
#define BROADCAST(w) _mm512_set1_epi32((int)(w))
#define MUL_EVEN(a, b) _mm512_mul_epu32(a, b)
#define SHIFT_DOWN(a) _mm512_srli_epi64(a, 32)
#define SHIFT_UP(a) _mm512_slli_epi64(a, 32)
#define ODD_FROM(a, b) _mm512_mask_blend_epi32(0xAAAA, a, b)
#define XOR3(a, b, c) _mm512_ternarylogic_epi32(a, b, c, 0x96)
#else
typedef __m256i words;
#define WIDTH 8
#define LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define STORE(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define BROADCAST(w) _mm256_set1_epi32((int)(w))
#define MUL_EVEN(a, b) _mm256_mul_epu32(a, b)
#define SHIFT_DOWN(a) _mm256_srli_epi64(a, 32)
#define SHIFT_UP(a) _mm256_slli_epi64(a, 32)
#define ODD_FROM(a, b) _mm256_blend_epi32(a, b, 0xAA)
#define XOR3(a, b, c) _mm256_xor_si256(_mm256_xor_si256(a, b), c)
#endif
#define GROUPS (LANES / WIDTH)

static void philox_rounds(uint32_t *restrict x0, uint32_t *restrict x1, uint32_t *restrict x2,
                          uint32_t *restrict x3, uint32_t k0, uint32_t k1) {
    const words m0 = BROADCAST(PHILOX_M0), m1 = BROADCAST(PHILOX_M1);
    words a0[GROUPS], a1[GROUPS], a2[GROUPS], a3[GROUPS];
    for (int g = 0; g < GROUPS; g++) {
        a0[g] = LOAD(x0 + WIDTH * g); a1[g] = LOAD(x1 + WIDTH * g);
        a2[g] = LOAD(x2 + WIDTH * g); a3[g] = LOAD(x3 + WIDTH * g);
    }
    for (int round = 0; round < 10; round++) {
        words r0 = BROADCAST(k0), r1 = BROADCAST(k1);
        for (int g = 0; g < GROUPS; g++) {  /* independent groups: their products overlap */
            words p0e = MUL_EVEN(a0[g], m0), p0o = MUL_EVEN(SHIFT_DOWN(a0[g]), m0);
            words p1e = MUL_EVEN(a2[g], m1), p1o = MUL_EVEN(SHIFT_DOWN(a2[g]), m1);
            a0[g] = XOR3(ODD_FROM(SHIFT_DOWN(p1e), p1o), a1[g], r0);  /* hi(M1 x2) ^ x1 ^ k0 */
            a2[g] = XOR3(ODD_FROM(SHIFT_DOWN(p0e), p0o), a3[g], r1);  /* hi(M0 x0) ^ x3 ^ k1 */
            a1[g] = ODD_FROM(p1e, SHIFT_UP(p1o));                       /* lo(M1 x2) */
            a3[g] = ODD_FROM(p0e, SHIFT_UP(p0o));                       /* lo(M0 x0) */
        }
        k0 += PHILOX_W0; k1 += PHILOX_W1;
    }
    for (int g = 0; g < GROUPS; g++) {
        STORE(x0 + WIDTH * g, a0[g]); STORE(x1 + WIDTH * g, a1[g]);
        STORE(x2 + WIDTH * g, a2[g]); STORE(x3 + WIDTH * g, a3[g]);
    }
}
#else
static void philox_rounds(uint32_t *restrict x0, uint32_t *restrict x1, uint32_t *restrict x2,
                          uint32_t *restrict x3, uint32_t k0, uint32_t k1) {
    for (int round = 0; round < 10; round++) {
#pragma omp simd
        for (int b = 0; b < LANES; b++) {
            uint64_t p0 = (uint64_t)PHILOX_M0 * x0[b], p1 = (uint64_t)PHILOX_M1 * x2[b];
            uint32_t y0 = (uint32_t)(p1 >> 32) ^ x1[b] ^ k0, y2 = (uint32_t)(p0 >> 32) ^ x3[b] ^ k1;
            x0[b] = y0; x1[b] = (uint32_t)p1; x2[b] = y2; x3[b] = (uint32_t)p0;
        }
        k0 += PHILOX_W0; k1 += PHILOX_W1;
    }
}
#endif

static void box_muller(const uint32_t *restrict wr, const uint32_t *restrict wa,
                       float *restrict zc, float *restrict zs) {
#pragma omp simd
    for (int b = 0; b < LANES; b++) {
        float u = ((float)(int32_t)(wr[b] >> 1) + 0.5f) * 0x1p-31f;
        uint32_t bits = as_bits(u), big = (bits & 0x7FFFFFu) > 0x3504F3u;  /* mantissa above sqrt(2) */
        float m = as_float((bits & 0x7FFFFFu) | (0x3F800000u - (big << 23)));
        float e = (float)((int32_t)(bits >> 23) - 127 + (int32_t)big);
        float s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
        float p = 0x1.555556p-2f + s2 * (0x1.99999ap-3f + s2 * (0x1.24924ap-3f + s2 * 0x1.c71c72p-4f));
        float ln_u = e * 0x1.62e43p-1f + (2.0f * s + (2.0f * s) * (s2 * p));
        float r = __builtin_sqrtf(-2.0f * ln_u);
        uint32_t q = wa[b] >> 30;
        float t = ((float)(int32_t)((wa[b] >> 6) & 0xFFFFFFu) * 0x1p-24f - 0.5f) * 0x1.921fb6p+0f, t2 = t * t;
        float st = t + (t * t2) * (SIN3 + t2 * (SIN5 + t2 * (SIN7 + t2 * SIN9)));
        float ct = 1.0f + t2 * (COS2 + t2 * (COS4 + t2 * (COS6 + t2 * (COS8 + t2 * COS10))));
        uint32_t c45 = as_bits((ct - st) * 0x1.6a09e6p-1f), s45 = as_bits((ct + st) * 0x1.6a09e6p-1f);
        uint32_t swap = 0u - (q & 1u);  /* quadrants 1 and 3 swap cos and sin */
        zc[b] = r * as_float(((s45 & swap) | (c45 & ~swap)) ^ (((q ^ (q >> 1)) & 1u) << 31));
        zs[b] = r * as_float(((c45 & swap) | (s45 & ~swap)) ^ ((q >> 1) << 31));
    }
}

/* Not inlined: inlined into the loop below, the tile stayed in registers and the passes that
 * divide took about 1.7 times as long (GCC 12, AVX-512). */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((noinline))
#endif
static void tile(uint64_t first_block, uint32_t k0, uint32_t k1, uint32_t c2, uint32_t c3,
                 float std, float *restrict z) {
    uint32_t x0[LANES], x1[LANES], x2[LANES], x3[LANES];
    for (int b = 0; b < LANES; b++) {
        uint64_t block = first_block + (uint64_t)b;
        x0[b] = (uint32_t)block; x1[b] = (uint32_t)(block >> 32); x2[b] = c2; x3[b] = c3;
    }
    philox_rounds(x0, x1, x2, x3, k0, k1);
    box_muller(x0, x1, z, z + LANES);
    box_muller(x2, x3, z + 2 * LANES, z + 3 * LANES);
#pragma omp simd
    for (int i = 0; i < TILE; i++) z[i] = z[i] * std;
}

/* Elements [start, start + count) of the stream into out (start: a multiple of 256). */
void opacus_dp_philox_normal(float *out, const float *base, int64_t start, int64_t count,
                             uint32_t k0, uint32_t k1, uint32_t c2, uint32_t c3, float std, float divisor) {
    float z[TILE];
    int divide = divisor != 1.0f;
    for (int64_t done = 0; done < count; done += TILE) {
        int64_t n = count - done < TILE ? count - done : TILE;
        float *o = out + done;
        uint64_t first_block = (uint64_t)((start + done) / TILE) * LANES;
        if (!base && !divide && n == TILE) {  /* a whole tile of plain noise: drawn in place */
            tile(first_block, k0, k1, c2, c3, std, o);
            continue;
        }
        tile(first_block, k0, k1, c2, c3, std, z);
        if (base) {
            const float *a = base + done;
            if (divide) {
                for (int64_t i = 0; i < n; i++) o[i] = (a[i] + z[i]) / divisor;
            } else {
                for (int64_t i = 0; i < n; i++) o[i] = a[i] + z[i];
            }
        } else if (divide) {
            for (int64_t i = 0; i < n; i++) o[i] = z[i] / divisor;
        } else {
            for (int64_t i = 0; i < n; i++) o[i] = z[i];
        }
    }
}

/* The same elements on a team of threads: `gomp_parallel` is GOMP_parallel of the OpenMP runtime
 * torch runs its operations on (found by the loader, never linked here), which runs `run_chunks`
 * on `threads` threads, the caller among them, and returns when all are done. The threads take
 * chunks of `chunk` elements (a multiple of 256) in turn from a shared counter: every chunk is
 * drawn once, by one thread, each element the same as in one call of opacus_dp_philox_normal. */
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);

struct chunked_job {
    float *out;
    const float *base;
    int64_t start, count, chunk, next;
    uint32_t k0, k1, c2, c3;
    float std, divisor;
};

static void run_chunks(void *data) {
    struct chunked_job *job = data;
    for (;;) {
        int64_t done = __atomic_fetch_add(&job->next, job->chunk, __ATOMIC_RELAXED);
        if (done >= job->count) return;
        int64_t n = job->count - done < job->chunk ? job->count - done : job->chunk;
        opacus_dp_philox_normal(job->out + done, job->base ? job->base + done : 0, job->start + done, n,
                                job->k0, job->k1, job->c2, job->c3, job->std, job->divisor);
    }
}

/* Returns the shared counter at the end: at least `count` once the team has run (0: it did not). */
int64_t opacus_dp_philox_normal_parallel(void *gomp_parallel, unsigned threads, int64_t chunk, float *out,
                                         const float *base, int64_t start, int64_t count, uint32_t k0,
                                         uint32_t k1, uint32_t c2, uint32_t c3, float std, float divisor) {
    struct chunked_job job = {out, base, start, count, chunk, 0, k0, k1, c2, c3, std, divisor};
    ((gomp_parallel_fn)gomp_parallel)(run_chunks, &job, threads, 0u);
    return __atomic_load_n(&job.next, __ATOMIC_SEQ_CST);
}

int opacus_dp_philox_version(void) { return 3; }
