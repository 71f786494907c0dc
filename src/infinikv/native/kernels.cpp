// infinikv's native CPU kernels: the decode step's weight products and its attention.
//
// One source for every x86 machine: built on the machine that runs it with -march=native, the
// preprocessor picks AVX-512, AVX2+FMA or plain C++ (see `Simd` below). Each op has a reference in
// Python (infinikv/native/__init__.py) that the tests compare it with.
//
// Registered as torch ops (namespace `infinikv`) so that torch.compile sees them as opaque calls.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define INFINIKV_SIMD 1
#include <immintrin.h>
#endif

namespace {

// ---- a few SIMD operations over W floats ---------------------------------------------------------
#if defined(__AVX512F__)
constexpr int W = 16;
using vf = __m512;
inline vf zero() { return _mm512_setzero_ps(); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
inline float hmax(vf v) { return _mm512_reduce_max_ps(v); }
// W bytes of a packed int4 group: low nibbles (the group's first half) and high nibbles (second half)
inline void nibbles(const uint8_t* p, vf& lo, vf& hi) {
  __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
inline vf widen(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vf vexp2i(__m512i n) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23)); }
inline __m512i vround(vf x) { return _mm512_cvtps_epi32(x); }
inline vf vfloat(__m512i n) { return _mm512_cvtepi32_ps(n); }
inline vf where_at_least(vf x, float bound, vf v) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, set1(bound), _CMP_GE_OQ), v); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int W = 8;
using vf = __m256;
inline vf zero() { return _mm256_setzero_ps(); }
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf set1(float x) { return _mm256_set1_ps(x); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline float hsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline void nibbles(const uint8_t* p, vf& lo, vf& hi) {
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
inline vf widen(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf vexp2i(__m256i n) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23)); }
inline __m256i vround(vf x) { return _mm256_cvtps_epi32(x); }
inline vf vfloat(__m256i n) { return _mm256_cvtepi32_ps(n); }
inline vf where_at_least(vf x, float bound, vf v) { return _mm256_and_ps(v, _mm256_cmp_ps(x, set1(bound), _CMP_GE_OQ)); }
#else
constexpr int W = 1;
using vf = float;
inline vf zero() { return 0.f; }
inline vf load(const float* p) { return *p; }
inline void store(float* p, vf v) { *p = v; }
inline vf set1(float x) { return x; }
inline vf add(vf a, vf b) { return a + b; }
inline vf sub(vf a, vf b) { return a - b; }
inline vf mul(vf a, vf b) { return a * b; }
inline vf fma(vf a, vf b, vf c) { return a * b + c; }
inline vf vmax(vf a, vf b) { return std::max(a, b); }
inline float hsum(vf v) { return v; }
inline float hmax(vf v) { return v; }
inline void nibbles(const uint8_t* p, vf& lo, vf& hi) {
  lo = static_cast<float>(*p & 15);
  hi = static_cast<float>(*p >> 4);
}
inline vf widen(const int8_t* p) { return static_cast<float>(*p); }
#endif

// exp(x) for x <= 0 (softmax after subtracting the max): 2^n * p(r), r = x - n ln2, |r| <= ln2/2;
// a degree-6 polynomial, relative error ~2e-7 (the precision of float); below -87 (a masked
// slot's -inf included) exactly 0, so a hidden slot never weighs anything.
inline vf vexp(vf input) {
#ifdef INFINIKV_SIMD
  vf x = vmax(input, set1(-87.f));
  vf n = vfloat(vround(mul(x, set1(1.44269504088896341f))));
  vf r = fma(n, set1(-0.693359375f), x);
  r = fma(n, set1(2.12194440e-4f), r);
  vf p = set1(1.9875691500e-4f);
  p = fma(p, r, set1(1.3981999507e-3f));
  p = fma(p, r, set1(8.3334519073e-3f));
  p = fma(p, r, set1(4.1665795894e-2f));
  p = fma(p, r, set1(1.6666665459e-1f));
  p = fma(p, r, set1(5.0000001201e-1f));
  p = fma(p, mul(r, r), add(r, set1(1.f)));
  return where_at_least(input, -87.f, mul(p, vexp2i(vround(n))));
#else
  return std::exp(input);
#endif
}

inline float sum_floats(const float* p, int64_t n) {
  vf acc = zero();
  int64_t i = 0;
  for (; i + W <= n; i += W) acc = add(acc, load(p + i));
  float s = hsum(acc);
  for (; i < n; ++i) s += p[i];
  return s;
}

constexpr int64_t GROUP = 32;  // int4 values per scale and minimum
constexpr int ROWS = 4;        // output rows computed together (independent accumulators)

void check_cpu_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

}  // namespace

// R output rows of int4 weights against MB input rows, every weight unpacked once for all MB
// (accumulators R x MB stay in registers: the loops below have constant bounds and unroll).
template <int R, int MB>
void int4_block(const float* x, int64_t K, const float* group_sums, const uint8_t* w, const float* scale,
                const float* minimum, int64_t n0, float* y, int64_t N) {
  constexpr int C = (GROUP / 2) / W;  // vectors of low (and of high) nibbles per group
  const int64_t G = K / GROUP;
  vf acc[R][MB];
  float lows[R][MB];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) acc[r][m] = zero(), lows[r][m] = 0.f;
  for (int64_t g = 0; g < G; ++g) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* bytes = w + (n0 + r) * (K / 2) + g * (GROUP / 2);
#ifdef INFINIKV_SIMD
      // the next block's rows, a few groups ahead: rows lie far apart, further than the hardware
      // prefetcher follows (measured: every layer's products, cold, 3.8 against 4.8 ms a step)
      if ((g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(bytes + R * (K / 2)), _MM_HINT_T0);
#endif
      vf lo[C], hi[C];
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) nibbles(bytes + c * W, lo[c], hi[c]);
      const vf s = set1(scale[(n0 + r) * G + g]);
      const float mn = minimum[(n0 + r) * G + g];
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const float* xg = x + m * K + g * GROUP;
        vf t = mul(lo[0], load(xg));
        t = fma(hi[0], load(xg + GROUP / 2), t);
#pragma GCC unroll 16
        for (int c = 1; c < C; ++c) {
          t = fma(lo[c], load(xg + c * W), t);
          t = fma(hi[c], load(xg + GROUP / 2 + c * W), t);
        }
        acc[r][m] = fma(t, s, acc[r][m]);
        lows[r][m] += mn * group_sums[m * G + g];
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) y[m * N + n0 + r] = hsum(acc[r][m]) + lows[r][m];
}

template <int R>
void int4_rows(const float* x, int64_t M, int64_t K, const float* sums, const uint8_t* w, const float* scale,
               const float* minimum, int64_t n0, float* y, int64_t N) {
  const int64_t G = K / GROUP;
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) int4_block<R, 4>(x + m * K, K, sums + m * G, w, scale, minimum, n0, y + m * N, N);
  switch (M - m) {
    case 3: int4_block<R, 3>(x + m * K, K, sums + m * G, w, scale, minimum, n0, y + m * N, N); break;
    case 2: int4_block<R, 2>(x + m * K, K, sums + m * G, w, scale, minimum, n0, y + m * N, N); break;
    case 1: int4_block<R, 1>(x + m * K, K, sums + m * G, w, scale, minimum, n0, y + m * N, N); break;
    default: break;
  }
}

// y [M, N] = x [M, K] times W^T, W stored as int4: `packed` [N, K/2] uint8, each group of 32 values of
// a row in 16 bytes (byte i: value i in the low nibble, value i + 16 in the high one), and w = q *
// scale + minimum with `scale`, `minimum` [N, K/32] float32. Exact in float32 (no activation
// rounding): what the dequantized weight times x gives, up to the order of the sums.
at::Tensor int4_linear(const at::Tensor& x_, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& minimum) {
  check_cpu_float(x_, "x");
  auto x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), G = K / GROUP;
  TORCH_CHECK(K % GROUP == 0 && packed.size(1) == K / 2 && packed.is_contiguous(), "int4_linear: bad shapes");
  TORCH_CHECK(scale.is_contiguous() && minimum.is_contiguous() && scale.size(1) == G, "int4_linear: bad scales");
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = minimum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<float> sums(M * G);  // the minimum's term: minimum[n, g] * sum of x over group g
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) sums[m * G + g] = sum_floats(xp + m * K + g * GROUP, GROUP);
  const int64_t blocks = (N + ROWS - 1) / ROWS;
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * ROWS;
      if (n0 + ROWS <= N) {
        int4_rows<ROWS>(xp, M, K, sums.data(), wp, sp, mp, n0, yp, N);
      } else {
        for (int64_t n = n0; n < N; ++n) int4_rows<1>(xp, M, K, sums.data(), wp, sp, mp, n, yp, N);
      }
    }
  });
  return y;
}

// The float32 weight [N, K] that `int4_linear`'s operands stand for, q * scale + minimum, in one pass
// (a prefill chunk's many rows multiply it with torch's GEMM): torch's ops took four passes over
// the float32 weight and were most of a short prompt's prefill (Qwen2.5-0.5B, 128 tokens, 1 thread).
at::Tensor int4_dequantize(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& minimum) {
  const int64_t N = packed.size(0), K = packed.size(1) * 2, G = K / GROUP;
  TORCH_CHECK(packed.is_contiguous() && scale.is_contiguous() && minimum.is_contiguous(), "int4_dequantize: not contiguous");
  TORCH_CHECK(scale.size(0) == N && scale.size(1) == G && minimum.sizes() == scale.sizes(), "int4_dequantize: bad scales");
  auto out = at::empty({N, K}, scale.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = minimum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N * G, 256, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* bytes = wp + g * (GROUP / 2);
      float* dst = op + g * GROUP;
      const vf s = set1(sp[g]), mn = set1(mp[g]);
      for (int c = 0; c < (GROUP / 2) / W; ++c) {
        vf lo, hi;
        nibbles(bytes + c * W, lo, hi);
        store(dst + c * W, add(mul(lo, s), mn));
        store(dst + GROUP / 2 + c * W, add(mul(hi, s), mn));
      }
    }
  });
  return out;
}

// y [M, N] = x [M, K] times W^T, W = q * scale with q [N, K] int8 and one scale [N] per row.
at::Tensor int8_linear(const at::Tensor& x_, const at::Tensor& q, const at::Tensor& scale) {
  check_cpu_float(x_, "x");
  auto x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K && q.is_contiguous() && scale.numel() == N, "int8_linear: bad shapes");
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + ROWS - 1) / ROWS;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * ROWS, rows = std::min<int64_t>(ROWS, N - n0);
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = xp + m * K;
        for (int r = 0; r < rows; ++r) {
          const int8_t* row = wp + (n0 + r) * K;
          vf a0 = zero(), a1 = zero();
          int64_t k = 0;
          for (; k + 2 * W <= K; k += 2 * W) {
            a0 = fma(widen(row + k), load(xr + k), a0);
            a1 = fma(widen(row + k + W), load(xr + k + W), a1);
          }
          float s = hsum(add(a0, a1));
          for (; k < K; ++k) s += row[k] * xr[k];
          yp[m * N + n0 + r] = s * sp[n0 + r];
        }
      }
    }
  });
  return y;
}

// One query per row and head against L key/value slots (a decode step), grouped-query:
// q [b, H, d]; k, v [b, h, L, d] (slots may be a view of larger storage: each slot's d values
// contiguous); visible [b, 1 or h, L] bool or empty (all visible); bias [b, h, L] float or empty.
// Returns out [b, H, d] and, with want_mass, mass [b, h, L]: each slot's probability summed over
// the H/h query heads of its KV head (what eviction rules accumulate). Flash-decoding: the slots
// are cut into splits, each split's softmax is local and the splits are merged at the end, so K
// and V are read once.
std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q_, const at::Tensor& k, const at::Tensor& v,
                                                    const c10::optional<at::Tensor>& visible_,
                                                    const c10::optional<at::Tensor>& bias_, double scale,
                                                    bool want_mass) {
  check_cpu_float(q_, "query");
  check_cpu_float(k, "keys");
  check_cpu_float(v, "values");
  auto q = q_.contiguous();
  const int64_t b = q.size(0), H = q.size(1), d = q.size(2), h = k.size(1), L = k.size(2), g = H / h;
  TORCH_CHECK(k.size(3) == d && v.size(3) == d && k.stride(3) == 1 && v.stride(3) == 1 && H % h == 0,
              "decode_attention: bad shapes");
  TORCH_CHECK(d % W == 0, "decode_attention: head dim must be a multiple of ", W);
  const bool has_visible = visible_.has_value() && visible_->defined();
  const bool has_bias = bias_.has_value() && bias_->defined();
  at::Tensor visible = has_visible ? *visible_ : at::Tensor();
  at::Tensor bias = has_bias ? bias_->contiguous() : at::Tensor();
  if (has_visible) TORCH_CHECK(visible.scalar_type() == at::kBool && visible.stride(2) == 1, "bad visibility");
  auto out = at::empty({b, H, d}, q.options());
  auto mass = want_mass ? at::empty({b, h, L}, q.options()) : at::empty({0}, q.options());
  if (L == 0) {
    out.zero_();
    return {out, mass};
  }
  const int64_t threads = at::get_num_threads();
  const int64_t wanted = std::max<int64_t>(1, (2 * threads + b * h - 1) / (b * h));
  const int64_t split = std::max<int64_t>(256, (L + wanted - 1) / wanted);
  const int64_t splits = (L + split - 1) / split, tasks = b * h * splits;
  auto probs = at::empty({b, h, g, L}, q.options());  // exp(logit - the split's max)
  std::vector<float> part_max(tasks * g), part_sum(tasks * g), part_out(tasks * g * d);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* visp = has_visible ? visible.data_ptr<bool>() : nullptr;
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* pp = probs.data_ptr<float>();
  const float NEG = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qs(g * d);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t bh = task / splits, bi = bh / h, hi = bh % h, s = task % splits;
      const int64_t l0 = s * split, l1 = std::min(L, l0 + split);
      const float* K = kp + bi * k.stride(0) + hi * k.stride(1);
      const float* V = vp + bi * v.stride(0) + hi * v.stride(1);
      const int64_t ks = k.stride(2), vs = v.stride(2);
      const bool* vis = has_visible ? visp + bi * visible.stride(0) + (visible.size(1) == 1 ? 0 : hi * visible.stride(1)) : nullptr;
      const float* bias_row = has_bias ? bp + (bi * h + hi) * L : nullptr;
      for (int64_t gi = 0; gi < g; ++gi)
        for (int64_t j = 0; j < d; ++j) qs[gi * d + j] = qp[(bi * H + hi * g + gi) * d + j] * static_cast<float>(scale);
      float* P = pp + (bh * g) * L;
      // logits (each slot's keys read once for every query head), then each head's max over the split
      for (int64_t l = l0; l < l1; ++l) {
        if (vis && !vis[l]) {  // a hidden slot (an empty one of fixed storage): its keys are never read
          for (int64_t gi = 0; gi < g; ++gi) P[gi * L + l] = NEG;
          continue;
        }
        const float* kr = K + l * ks;
        const float extra = bias_row ? bias_row[l] : 0.f;
        for (int64_t gi = 0; gi < g; ++gi) {
          const float* qg = qs.data() + gi * d;
          vf a = zero();
          for (int64_t j = 0; j < d; j += W) a = fma(load(qg + j), load(kr + j), a);
          P[gi * L + l] = hsum(a) + extra;
        }
      }
      for (int64_t gi = 0; gi < g; ++gi) {
        const float* row = P + gi * L;
        vf mx = set1(NEG);
        int64_t l = l0;
        for (; l + W <= l1; l += W) mx = vmax(mx, load(row + l));
        float m = hmax(mx);
        for (; l < l1; ++l) m = std::max(m, row[l]);
        part_max[task * g + gi] = m;
      }
      // probabilities relative to the split's max, their sum, and the split's weighted values
      for (int64_t gi = 0; gi < g; ++gi) {
        float* row = P + gi * L;
        const float m = part_max[task * g + gi];
        float* o = part_out.data() + (task * g + gi) * d;
        std::fill(o, o + d, 0.f);
        if (m == NEG) {  // nothing visible in this split
          for (int64_t l = l0; l < l1; ++l) row[l] = 0.f;
          part_sum[task * g + gi] = 0.f;
          continue;
        }
        vf total = zero();
        int64_t l = l0;
        for (; l + W <= l1; l += W) {
          vf p = vexp(sub(load(row + l), set1(m)));
          store(row + l, p);
          total = add(total, p);
        }
        float sum = hsum(total);
        for (; l < l1; ++l) {
          row[l] = std::exp(row[l] - m);
          sum += row[l];
        }
        part_sum[task * g + gi] = sum;
        for (int64_t j = 0; j < d; j += 4 * W) {  // four vectors of the head dim per pass over the slots
          const int chunks = static_cast<int>(std::min<int64_t>(4, (d - j) / W));
          vf acc[4] = {zero(), zero(), zero(), zero()};
          for (int64_t ll = l0; ll < l1; ++ll) {
            if (row[ll] == 0.f) continue;  // hidden: its values are never read either
            const vf p = set1(row[ll]);
            const float* vr = V + ll * vs + j;
            for (int c = 0; c < chunks; ++c) acc[c] = fma(p, load(vr + c * W), acc[c]);
          }
          for (int c = 0; c < chunks; ++c) store(o + j + c * W, acc[c]);
        }
      }
    }
  });
  // merge the splits: each one's weight is exp(its max - the global max)
  std::vector<float> weight(tasks * g), inverse(b * h * g);
  float* op = out.data_ptr<float>();
  for (int64_t bh = 0; bh < b * h; ++bh) {
    const int64_t bi = bh / h, hi = bh % h;
    for (int64_t gi = 0; gi < g; ++gi) {
      float m = NEG;
      for (int64_t s = 0; s < splits; ++s) m = std::max(m, part_max[(bh * splits + s) * g + gi]);
      float total = 0.f;
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t at = (bh * splits + s) * g + gi;
        weight[at] = part_max[at] == NEG ? 0.f : std::exp(part_max[at] - m);
        total += weight[at] * part_sum[at];
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      inverse[bh * g + gi] = inv;
      float* o = op + (bi * H + hi * g + gi) * d;
      std::fill(o, o + d, 0.f);
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t at = (bh * splits + s) * g + gi;
        const float w = weight[at] * inv;
        const float* po = part_out.data() + at * d;
        for (int64_t j = 0; j < d; ++j) o[j] += w * po[j];
      }
    }
  }
  if (want_mass) {
    float* mp = mass.data_ptr<float>();
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t bh = task / splits, s = task % splits;
        const int64_t l0 = s * split, l1 = std::min(L, l0 + split);
        float* dst = mp + bh * L;
        std::fill(dst + l0, dst + l1, 0.f);
        for (int64_t gi = 0; gi < g; ++gi) {
          const float f = weight[task * g + gi] * inverse[bh * g + gi];
          const float* row = pp + (bh * g + gi) * L;
          int64_t l = l0;
          for (; l + W <= l1; l += W) store(dst + l, fma(load(row + l), set1(f), load(dst + l)));
          for (; l < l1; ++l) dst[l] += row[l] * f;
        }
      }
    });
  }
  return {out, mass};
}

// The slot each (row, KV head) evicts next: the valid slot with the lowest score (scores above
// float's max count as its max, so a slot never to be evicted still goes before an empty one), the
// newest among equal scores; and how many slots are valid. scores [b, h, L] float, valid [b, h, L]
// bool, position [b, h, L] int64 (each with its last dim contiguous) -> victims, held [b, h, 1] int64.
// One pass, where the torch reference takes five (a min, a compare, a masked argmax, a sum).
std::tuple<at::Tensor, at::Tensor> lowest_slot(const at::Tensor& scores, const at::Tensor& valid,
                                               const at::Tensor& position) {
  check_cpu_float(scores, "scores");
  TORCH_CHECK(valid.scalar_type() == at::kBool && position.scalar_type() == at::kLong, "lowest_slot: dtypes");
  TORCH_CHECK(scores.stride(2) == 1 && valid.stride(2) == 1 && position.stride(2) == 1, "lowest_slot: layout");
  const int64_t b = scores.size(0), h = scores.size(1), L = scores.size(2);
  auto victims = at::empty({b, h, 1}, position.options());
  auto held = at::empty({b, h, 1}, position.options());
  const float* sp = scores.data_ptr<float>();
  const bool* vp = valid.data_ptr<bool>();
  const int64_t* pp = position.data_ptr<int64_t>();
  int64_t* out = victims.data_ptr<int64_t>();
  int64_t* count = held.data_ptr<int64_t>();
  const float top = std::numeric_limits<float>::max(), empty = std::numeric_limits<float>::infinity();
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t hi = 0; hi < h; ++hi) {
      const float* sr = sp + bi * scores.stride(0) + hi * scores.stride(1);
      const bool* vr = vp + bi * valid.stride(0) + hi * valid.stride(1);
      const int64_t* pr = pp + bi * position.stride(0) + hi * position.stride(1);
      float best = empty;
      int64_t slot = 0, newest = std::numeric_limits<int64_t>::min(), n = 0;
      for (int64_t l = 0; l < L; ++l) {
        const float score = vr[l] ? std::min(sr[l], top) : empty;
        n += vr[l];
        if (score < best || (score == best && pr[l] > newest)) best = score, slot = l, newest = pr[l];
      }
      out[bi * h + hi] = slot;
      count[bi * h + hi] = n;
    }
  }
  return {victims, held};
}

// RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * (weight + offset) (offset 1 for Gemma's).
at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& weight, double eps, double offset) {
  check_cpu_float(x_, "x");
  check_cpu_float(weight, "weight");
  auto x = x_.contiguous();
  const int64_t D = x.size(-1), rows = x.numel() / D;
  auto y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto body = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * D;
      float* yr = yp + r * D;
      vf acc = zero();
      int64_t i = 0;
      for (; i + W <= D; i += W) acc = fma(load(xr + i), load(xr + i), acc);
      float ss = hsum(acc);
      for (; i < D; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
      const float off = static_cast<float>(offset);
      for (i = 0; i < D; ++i) yr[i] = (xr[i] * inv) * (wp[i] + off);
    }
  };
  if (rows < 64) {
    body(0, rows);
  } else {
    at::parallel_for(0, rows, 16, body);
  }
  return y;
}

TORCH_LIBRARY(infinikv, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scale, Tensor minimum) -> Tensor");
  m.def("int4_dequantize(Tensor packed, Tensor scale, Tensor minimum) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def(
      "decode_attention(Tensor query, Tensor keys, Tensor values, Tensor? visible, Tensor? bias, float scale, "
      "bool want_mass) -> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor");
  m.def("lowest_slot(Tensor scores, Tensor valid, Tensor position) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(infinikv, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("int8_linear", &int8_linear);
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("lowest_slot", &lowest_slot);
}
