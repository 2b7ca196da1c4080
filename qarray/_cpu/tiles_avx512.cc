// qarray's AVX-512 VNNI tiles (Intel since Ice Lake, AMD since Zen 4): a tile
// provider of gemm.h's drivers, like tiles_avx2.cc and tiles_neon.cc, whose
// vector holds a whole panel step (16 channels x 4 k).
//
// vpdpbusd multiplies unsigned bytes by signed ones, so x's int8 rows are
// stored as level + 128 (kXBias) and the tiles subtract 128 x the weights'
// sums, which gemm.h keeps per panel. What is AVX-512's own: the few-row paths
// below the GEMM's thresholds (gemm.h's dot paths are 8 lanes wide), which
// take masked tails instead of padding:
//   nk (linear_q), below gemm_rows int8 rows (W8A8 rows, or weight-only's
//       split parts): dot products of the u8 rows against the weight rows, the
//       weights' sums taken in the same pass (NkRows);
//   kn (matmul_q), up to kn_dot_rows int8 rows: four weight rows at a time
//       interleaved in registers into vpdpbusd's four-byte groups, the weights
//       made unsigned (q + 128, corrected by 128 x sum(x) per row) against
//       broadcasts of x (KnDotProduct);
//   int4, below int4_gemm_rows rows: float32 tiles, each nibble its value
//       times the group's scale by one permute of a 16-entry table (Int4Rows).
// Every threshold is Python's (qarray/_formulations.py), passed in Thresholds.
//
// Compiled for any x86-64: the target pragma comes after every shared header,
// so nothing those headers define is compiled for AVX-512 (the linker could
// pick such a copy for code that runs without it); dispatch.cc calls these
// only where cpuid reports AVX-512 F, BW, VL and VNNI. Test builds
// (QARRAY_EMULATE_AVX512) take the intrinsics from SIMDe over AVX2.

#ifdef QARRAY_EMULATE_AVX512
#include "tests/avx512_emulation.h"
#else
#include <immintrin.h>
#endif

#include "common.h"

#ifndef QARRAY_EMULATE_AVX512
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")
#endif

namespace qarray::cpu::avx512 {

// gemm.h's packing helpers (8-channel blocks) and float transposes
#include "tiles_avx2.h"

// the vector type the row quantizer (quantize_row.h) runs on
struct VecAvx512 {
  static constexpr int W = 16;
  using F = __m512;
  using M = __mmask16;
  static F Load(const float* p) { return _mm512_loadu_ps(p); }
  static F Set1(float v) { return _mm512_set1_ps(v); }
  static F Zero() { return _mm512_setzero_ps(); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm512_div_ps(a, b); }
  static F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F Abs(F a) { return _mm512_abs_ps(a); }
  static F Max(F a, F b) { return _mm512_max_ps(a, b); }  // NaN in a: b
  static F Min(F a, F b) { return _mm512_min_ps(a, b); }
  static F Round(F a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static M None() { return 0; }
  static M Or(M a, M b) { return a | b; }
  static M Unord(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q); }
  static M Gt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static bool Any(M m) { return m != 0; }
  static F Select(M m, F a, F b) { return _mm512_mask_mov_ps(b, m, a); }
  static float ReduceMax(F a) { return _mm512_reduce_max_ps(a); }
  static void StoreF(float* p, F a) { _mm512_storeu_ps(p, a); }
  static void StoreS8(int8_t* p, F a) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a)));
  }
  static void StoreU8(uint8_t* p, F a) {  // level + 128 in [1, 255]
    const __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(a), _mm512_set1_epi32(128));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(q));
  }
  // 64 levels (integers in [-127, 127]) -> 64 bytes in order: two saturating
  // packs work within 128-bit lanes, the permutation undoes that
  static void StoreS8x4(int8_t* p, F a, F b, F c, F d, bool stream) {
    const __m512i bytes =
        _mm512_packs_epi16(_mm512_packs_epi32(_mm512_cvtps_epi32(a), _mm512_cvtps_epi32(b)),
                           _mm512_packs_epi32(_mm512_cvtps_epi32(c), _mm512_cvtps_epi32(d)));
    const __m512i order =
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i v = _mm512_permutexvar_epi32(order, bytes);
    if (stream)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(p), v);
    else
      _mm512_storeu_si512(p, v);
  }
  static void Fence() { _mm_sfence(); }
};

// gemm.h's tiles: a step's 16 channels in one vector, x unsigned
struct I8Avx512 : I8Avx2 {
  static constexpr int kLanes = 16, kXBias = 128;
  static constexpr bool kDotPaths = false;  // the few rows: below
  // a GEMM tile: 8 rows x 32 channels, 16 sums in registers, each of x's
  // broadcasts used twice and each weight vector 8 times (16 channels a tile
  // measured slower: make bench, suite kernels, the GEMM rows)
  static constexpr int kTileRows = 8, kTilePairs = 2;
  using Acc = __m512i;
  using W = __m512i;
  static Acc Zero() { return _mm512_setzero_si512(); }
  static W LoadW(const int8_t* p) { return _mm512_loadu_si512(p); }
  static Acc LoadAcc(const int32_t* p) { return _mm512_loadu_si512(p); }
  static void Store(int32_t* p, Acc a) { _mm512_storeu_si512(p, a); }
  static void ScaleInto(float* p, Acc a, const float* s, bool add) {
    const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_loadu_ps(s));
    _mm512_storeu_ps(p, add ? _mm512_add_ps(_mm512_loadu_ps(p), v) : v);
  }
  static void Dot(Acc& acc, const W& w, int32_t x4) {
    acc = _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(x4), w);
  }

  // int4 panels a pair at a time (two 8-channel blocks through AVX2's
  // packing cost more: make bench, suite int4)
  static constexpr bool kPacksPairs = true;
  // `lanes` (up to 16) channels of packed int4 rows (q, half bytes apart) ->
  // k / 4 steps of 64 bytes at dst, kStepBytes apart: 64 k of each channel
  // widened to int8, then 16 x 16 four-byte groups transposed
  static void PackInt4Pair(const uint8_t* q, int64_t half, int64_t lanes, int64_t k,
                           int8_t* dst) {
    const __m512i table = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1));
    const __m512i low4 = _mm512_set1_epi16(0x0F);
    for (int64_t i = 0; i < k; i += 64) {
      const int64_t bytes = std::min<int64_t>(32, (k - i) / 2);
      const __mmask32 m = bytes == 32 ? ~0u : (1u << bytes) - 1;
      __m512i r[16];
      for (int c = 0; c < 16; ++c) {
        if (c >= lanes) {
          r[c] = _mm512_setzero_si512();
          continue;
        }
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, q + c * half + i / 2));
        const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(b, low4));
        const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(b, 4), low4));
        r[c] = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 8));  // even k low, odd k high
      }
      Transpose16x4(r);
      for (int64_t e = 0; e < std::min<int64_t>(16, (k - i) / 4); ++e)
        _mm512_storeu_si512(dst + (i / 4 + e) * kStepBytes, r[e]);
    }
  }
  // 16 vectors of 16 four-byte groups transposed in place (group e of r[c]
  // becomes group c of r[e])
  static void Transpose16x4(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
      u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
      u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
      u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
      u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; ++j) {
      const __m512i a01 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
      const __m512i a23 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
      const __m512i b01 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
      const __m512i b23 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
      r[j] = _mm512_shuffle_i32x4(a01, b01, 0x88);
      r[4 + j] = _mm512_shuffle_i32x4(a01, b01, 0xDD);
      r[8 + j] = _mm512_shuffle_i32x4(a23, b23, 0x88);
      r[12 + j] = _mm512_shuffle_i32x4(a23, b23, 0xDD);
    }
  }
};

using I = I8Avx512;
#include "quantize_row.h"
#include "gemm.h"

inline __mmask64 Bytes(int64_t left) { return left >= 64 ? ~0ULL : (1ULL << left) - 1; }

// --- layout nk, a few rows: R u8 rows (level + 128, ks apart) from `row`
// times NB weight rows from c, each weight row read once for the R rows; its
// sum (what the +128 adds) in the same pass
template <int R, int NB>
void NkTile(const ProductState& s, int64_t row, int64_t c) {
  const ProductArgs& a = s.a;
  const uint8_t* x = reinterpret_cast<const uint8_t*>(s.xs.data()) + row * s.ks;
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i acc[R][NB], wsum[NB];
  for (int b = 0; b < NB; ++b) {
    wsum[b] = _mm512_setzero_si512();
    for (int r = 0; r < R; ++r) acc[r][b] = _mm512_setzero_si512();
  }
  for (int64_t i = 0; i < a.k; i += 64) {
    const __mmask64 m = Bytes(a.k - i);
    // the next tile's rows (a page apart each: the hardware prefetchers stop
    // at page ends); a hint, an address past the end does not fault
    for (int b = 0; b < NB; ++b) I::Prefetch(a.q + (c + 2 * NB + b) * a.k + i);
    __m512i w[NB];
    for (int b = 0; b < NB; ++b) {
      w[b] = _mm512_maskz_loadu_epi8(m, a.q + (c + b) * a.k + i);
      wsum[b] = _mm512_dpbusd_epi32(wsum[b], ones, w[b]);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_maskz_loadu_epi8(m, x + r * s.ks + i);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], xv, w[b]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t bias = 128LL * _mm512_reduce_add_epi32(wsum[b]);
    for (int r = 0; r < R; ++r) {
      const int64_t dot = _mm512_reduce_add_epi32(acc[r][b]) - bias;
      a.y[((row + r) / s.parts) * a.n + c + b] +=
          static_cast<float>(dot) * s.sx[row + r] * a.scale[c + b];
    }
  }
}

// channels [n0, n1) in tiles whose weights stay in L2 while every block of
// four rows passes over them, four channels at a time; the parts added into
// y in part order
void NkRows(const ProductState& s, int64_t n0, int64_t n1) {
  const ProductArgs& a = s.a;
  for (int64_t r = 0; r < a.m; ++r) std::fill(a.y + r * a.n + n0, a.y + r * a.n + n1, 0.0f);
  const int64_t tile = std::clamp<int64_t>(kPanelBytes / 2 / a.k / 4 * 4, 4, 256);
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(t0 + tile, n1);
    auto block = [&](auto rows, int64_t r) {
      constexpr int R = decltype(rows)::value;
      int64_t c = t0;
      for (; c + 4 <= t1; c += 4) NkTile<R, 4>(s, r, c);
      for (; c < t1; ++c) NkTile<R, 1>(s, r, c);
    };
    int64_t r = 0;
    for (; r + 4 <= s.rows; r += 4) block(std::integral_constant<int, 4>{}, r);
    if (s.rows - r == 3) block(std::integral_constant<int, 3>{}, r);
    if (s.rows - r == 2) block(std::integral_constant<int, 2>{}, r);
    if (s.rows - r == 1) block(std::integral_constant<int, 1>{}, r);
  }
}

// --- layout kn, a few rows (kn_dot_rows int8 rows at most)

// where column `off` of a 64-column block sits among its four accumulators
// (e: which unpack, lane L: which 16 columns, t: which of four)
inline int64_t KnDotColumn(int64_t off) {
  return 16 * ((off % 16) / 4) + 4 * (off / 16) + off % 4;
}

struct KnDot {
  std::shared_ptr<ProductState> s;
  int64_t rows, width, step, ranges;  // rows: an instantiated count; width: n to 64
  std::vector<int8_t> xs;     // rows x ks signed levels, zero past k
  std::vector<int32_t> acc;   // per range: rows x width sums, KnDotColumn's order
  std::vector<int64_t> xsum;  // per range: the rows' sums of levels
};

// four weight rows from `row` (rows past K meet zero entries of x: any
// readable row serves), columns [j, j + 64) masked by m, as vpdpbusd's
// unsigned four-byte groups in KnDotColumn's order
inline void KnDotQuads(const int8_t* const* row, int64_t j, __mmask64 m, __m512i* w) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i r[4];
  for (int t = 0; t < 4; ++t) r[t] = _mm512_maskz_loadu_epi8(m, row[t] + j);
  const __m512i lo01 = _mm512_unpacklo_epi8(r[0], r[1]), hi01 = _mm512_unpackhi_epi8(r[0], r[1]);
  const __m512i lo23 = _mm512_unpacklo_epi8(r[2], r[3]), hi23 = _mm512_unpackhi_epi8(r[2], r[3]);
  w[0] = _mm512_xor_si512(_mm512_unpacklo_epi16(lo01, lo23), flip);
  w[1] = _mm512_xor_si512(_mm512_unpackhi_epi16(lo01, lo23), flip);
  w[2] = _mm512_xor_si512(_mm512_unpacklo_epi16(hi01, hi23), flip);
  w[3] = _mm512_xor_si512(_mm512_unpackhi_epi16(hi01, hi23), flip);
}

// weight rows [k0, k1) into acc (rows x width) and xsum, for R int8 rows;
// S groups of four weight rows per pass over the sums (a load and a store of
// each sum per 4 S rows)
template <int R, int S>
void KnDotRange(const KnDot& d, int64_t k0, int64_t k1, int32_t* acc, int64_t* xsum) {
  const ProductArgs& a = d.s->a;
  const int64_t ks = d.s->ks;
  std::fill(acc, acc + R * d.width, 0);
  for (int r = 0; r < R; ++r) {
    int64_t sum = 0;
    for (int64_t i = k0; i < k1; ++i) sum += d.xs[r * ks + i];
    xsum[r] = sum;
  }
  for (int64_t i = k0; i < k1; i += 4 * S) {
    const int8_t* row[4 * S];
    for (int u = 0; u < 4 * S; ++u) row[u] = a.q + std::min(i + u, a.k - 1) * a.n;
    __m512i xv[S][R];
    for (int g = 0; g < S; ++g)
      for (int r = 0; r < R; ++r) {  // x is zero from k to ks
        int32_t four;
        std::memcpy(&four, d.xs.data() + r * ks + i + 4 * g, 4);
        xv[g][r] = _mm512_set1_epi32(four);
      }
    for (int64_t j = 0; j < d.width; j += 64) {
      const __mmask64 m = Bytes(a.n - j);
      for (int u = 0; u < 4 * S; ++u)  // two passes ahead: from memory in time
        I::Prefetch(row[u] + 8 * S * a.n + j);
      __m512i w[S][4];
      for (int g = 0; g < S; ++g) KnDotQuads(row + 4 * g, j, m, w[g]);
      for (int r = 0; r < R; ++r) {
        int32_t* at = acc + r * d.width + j;
        for (int e = 0; e < 4; ++e) {
          __m512i sum = _mm512_loadu_si512(at + 16 * e);
          for (int g = 0; g < S; ++g) sum = _mm512_dpbusd_epi32(sum, w[g][e], xv[g][r]);
          _mm512_storeu_si512(at + 16 * e, sum);
        }
      }
    }
  }
}

// the rows KnDotRun computes for `rows` int8 rows (the next instantiated count)
inline int64_t KnDotRows(int64_t rows) {
  static_assert(kMaxKnDotRows == 9, "KnDotRun instantiates counts up to kMaxKnDotRows");
  for (int64_t r : {1, 2, 3, 4, 6, 8, 9})
    if (rows <= r) return r;
  return -1;
}

void KnDotRun(const KnDot& d, int64_t c) {
  const int64_t k0 = c * d.step, k1 = std::min(k0 + d.step, d.s->a.k);
  int32_t* acc = const_cast<int32_t*>(d.acc.data()) + c * d.rows * d.width;
  int64_t* xsum = const_cast<int64_t*>(d.xsum.data()) + c * d.rows;
  switch (d.rows) {  // eight weight rows a pass while x's broadcasts fit in registers
    case 1: return KnDotRange<1, 2>(d, k0, k1, acc, xsum);
    case 2: return KnDotRange<2, 2>(d, k0, k1, acc, xsum);
    case 3: return KnDotRange<3, 2>(d, k0, k1, acc, xsum);
    case 4: return KnDotRange<4, 2>(d, k0, k1, acc, xsum);
    case 6: return KnDotRange<6, 2>(d, k0, k1, acc, xsum);
    case 8: return KnDotRange<8, 1>(d, k0, k1, acc, xsum);
    case 9: return KnDotRange<9, 1>(d, k0, k1, acc, xsum);
    default: return;
  }
}

// threads take contiguous ranges of weight rows (each streams its share of
// memory in order), their partial sums added at the end
void KnDotProduct(Pool& pool, int64_t threads, std::shared_ptr<ProductState> s) {
  auto d = std::make_shared<KnDot>();
  d->s = s;
  const ProductArgs& a = s->a;
  d->rows = KnDotRows(s->rows);  // rows past s->rows: zeros
  d->width = RoundUp(a.n, 64);
  d->xs.assign(d->rows * s->ks, 0);
  for (int64_t r = 0; r < s->rows; ++r)  // u8 (level + 128) -> the level
    for (int64_t i = 0; i < a.k; ++i)
      d->xs[r * s->ks + i] = static_cast<int8_t>(s->xs[r * s->ks + i] ^ 0x80);
  d->step = RoundUp((a.k + threads - 1) / threads, 8);
  d->ranges = (a.k + d->step - 1) / d->step;
  d->acc.resize(d->ranges * d->rows * d->width);
  d->xsum.resize(d->ranges * d->rows);
  const KnDot* p = d.get();
  Parallel(pool, d->ranges, 1, threads,
           [p](int64_t c0, int64_t c1) {
             for (int64_t c = c0; c < c1; ++c) KnDotRun(*p, c);
           },
           d);
  for (int64_t r = 0; r < a.m; ++r)
    for (int64_t j = 0; j < a.n; ++j) {
      const int64_t at = j / 64 * 64 + KnDotColumn(j % 64);
      float sum = 0.0f;
      for (int64_t part = 0; part < s->parts; ++part) {
        const int64_t row = s->parts * r + part;
        int64_t total = 0;
        for (int64_t c = 0; c < d->ranges; ++c)
          total += d->acc[(c * d->rows + row) * d->width + at] - 128 * d->xsum[c * d->rows + row];
        sum += s->sx[row] * static_cast<float>(total);
      }
      a.y[r * a.n + j] = sum;
    }
}

void Product(Pool& pool, const ProductArgs& a) {
  if (UsesGemm(a)) return ProductT<VecAvx512>(pool, a);
  const std::shared_ptr<ProductState> s = ProductRows<VecAvx512>(pool, a);
  if (!s) return;
  const int64_t threads = ProductThreads(pool, s->rows, a.k, a.n);
  if (a.kn) return KnDotProduct(pool, threads, s);
  const ProductState* p = s.get();
  Parallel(pool, a.n, ChunkSize(a.n, threads, 4), threads,
           [p](int64_t n0, int64_t n1) { NkRows(*p, n0, n1); }, s);
}

// --- int4 weights, a few rows (below int4_gemm_rows): float32 sums of x
// (W4A8: its int8 levels times their scale) against each byte's nibbles,
// x's even and odd entries split apart once per call

struct Int4Rows {
  Int4Args a;
  std::vector<float> xe, xo;  // x's even and odd entries, (m, k / 2) each
};

// MB rows from `row` times channels [n0, n1), over the groups [g0, g1),
// added to y
template <int MB>
void Int4Block(const Int4Rows& p, int64_t row, int64_t n0, int64_t n1, int64_t g0,
               int64_t g1) {
  const Int4Args& a = p.a;
  const int64_t half = a.k / 2, groups = a.k / a.group, group_bytes = a.group / 2;
  const float* xe = p.xe.data() + row * half;
  const float* xo = p.xo.data() + row * half;
  const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  for (int64_t j = n0; j < n1; ++j) {
    const uint8_t* q = a.q + j * half;
    const float* s = a.scale + j * groups;
    __m512 even[MB], odd[MB];  // two dependency chains per row
    for (int r = 0; r < MB; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    for (int64_t g = g0; g < g1; ++g) {
      const __m512 table = _mm512_mul_ps(values, _mm512_set1_ps(s[g]));
      for (int64_t b = g * group_bytes; b < (g + 1) * group_bytes; b += 16) {
        if ((b & 63) == 0)  // the same bytes four channels on, as NkTile
          I::Prefetch(reinterpret_cast<const int8_t*>(q + b + 4 * half));
        const __m512i bytes =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b)));
        // the permute reads the low 4 bits of each index
        const __m512 lo = _mm512_permutexvar_ps(bytes, table);
        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
#pragma GCC unroll 8
        for (int r = 0; r < MB; ++r) {
          even[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xe + r * half + b), even[r]);
          odd[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xo + r * half + b), odd[r]);
        }
      }
    }
    for (int r = 0; r < MB; ++r)
      a.y[(row + r) * a.n + j] += _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
  }
}

// channels in tiles whose packed weights stay in L2 while every block of rows
// passes over them; K in spans whose even and odd entries of a block of rows
// stay in L1 (16 KiB of them)
void Int4Chunk(const Int4Rows& p, int64_t n0, int64_t n1) {
  const Int4Args& a = p.a;
  const int64_t tile = std::clamp<int64_t>(kPanelBytes / a.k / 4 * 4, 4, 256);
  const int64_t groups = a.k / a.group;
  const int64_t span = std::max<int64_t>(1, 4096 / std::min<int64_t>(a.m, 8) / a.group);
  for (int64_t r = 0; r < a.m; ++r) std::fill(a.y + r * a.n + n0, a.y + r * a.n + n1, 0.0f);
  for (int64_t t0 = n0; t0 < n1; t0 += tile)
    for (int64_t g0 = 0; g0 < groups; g0 += span)
      ForRowBlocks(0, a.m, [&](auto mb, int64_t row) {
        Int4Block<decltype(mb)::value>(p, row, t0, std::min(t0 + tile, n1), g0,
                                       std::min(g0 + span, groups));
      });
}

void ProductInt4(Pool& pool, const Int4Args& a) {
  if (a.m >= a.t.int4_gemm_rows) return ProductInt4T<VecAvx512>(pool, a);
  if (a.m == 0 || a.n == 0) return;
  auto p = std::make_shared<Int4Rows>();
  p->a = a;
  const int64_t half = a.k / 2;
  p->xe.resize(a.m * half);
  p->xo.resize(a.m * half);
  std::vector<float> levels(a.int8 ? a.k : 0);
  for (int64_t r = 0; r < a.m; ++r) {
    const float* row = a.x + r * a.k;
    if (a.int8) {
      const float sx = QuantizeRowT<VecAvx512>(row, nullptr, a.k, RowOut{levels.data()});
      for (float& v : levels) v *= sx;
      row = levels.data();
    }
    for (int64_t i = 0; i < half; ++i) {
      p->xe[r * half + i] = row[2 * i];
      p->xo[r * half + i] = row[2 * i + 1];
    }
  }
  const int64_t threads = ProductThreads(pool, a.m, a.k, a.n);
  const Int4Rows* rows = p.get();
  Parallel(pool, a.n, ChunkSize(a.n, threads, 4), threads,
           [rows](int64_t n0, int64_t n1) { Int4Chunk(*rows, n0, n1); }, p);
}

void Conv(Pool& pool, const ConvArgs& a) { ConvT<VecAvx512>(pool, a); }
void Quantize(Pool& pool, const QuantizeArgs& a) { QuantizeT<VecAvx512>(pool, a); }

}  // namespace qarray::cpu::avx512

#ifndef QARRAY_EMULATE_AVX512
#pragma GCC pop_options
#endif

namespace qarray::cpu {
extern const Isa kAvx512 = {"avx512",          avx512::Product,
                            avx512::ProductInt4, avx512::Conv,
                            avx512::Quantize,    avx512::QuantizeRowEntry<avx512::VecAvx512>};
}  // namespace qarray::cpu
