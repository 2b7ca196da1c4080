// qarray's AVX-512 VNNI tiles (the handlers' arithmetic on this instruction set).
//
// The handlers (product.cc, product_int4.cc, conv.cc, quantize.cc) check
// shapes and call these through dispatch.cc's table. Product computes
// y f32[M, N] from x f32[M, K] and int8 weights with one scale per stored row:
//
//   layout nk (linear_q): q[N, K], scale[N]   y[m, n] = scale[n] * sum_k x[m, k] q[n, k]
//   layout kn (matmul_q): q[K, N], scale[K]   y[m, n] = sum_k (x[m, k] scale[k]) q[k, n]
//
// Weight-only (int8 == 0): x keeps float32 precision and the weights are read
// as int8 (a quarter of float32's bytes), never written back as a float32
// copy, which is what XLA:CPU does. nk: each row of x split in `split` int8
// parts (float32-exact, as _kernels' split_int8) through the W8A8 products
// below; kn: up to kn_dot_rows int8 rows (parts) into integer products
// of interleaved weight rows (KnDotProduct), more rows with the int8 weights
// widened in registers.
// Int8 activations (int8 == 1): each row v of x (scales folded in for kn) is
// quantized like qarray.quantize (quantize_row.h), then
//   nk: u8 (v + 128) x s8 dot products with vpdpbusd, minus 128 * rowsum(q);
//   kn: KnDotProduct on the integer rows for a few rows, else the widened
//       weights against them (exact f32 sums of integers up to 2^24), times s.
// Rows are taken MB at a time so that each weight load serves MB rows; the
// output channels are split in chunks over the pool's threads.
// From gemm_rows int8 rows (W8A8 rows, or weight-only's parts, in either
// layout; kn's weight-only then runs on split parts of x * scale too) each
// chunk repacks its weights for vpdpbusd and runs a register-blocked GEMM
// instead of the dot products (GemmChunk). ProductInt4 runs linear_q on packed
// int4 weights (float32 tiles for a row, then the same GEMM with the nibbles
// unpacked into the panel and the group scales applied to each group's integer
// sums); Conv runs conv_q as an implicit GEMM; Quantize, qarray.quantize.
//
// This file is compiled for any x86-64: its functions carry AVX-512's target
// (the pragma below, after every shared header, so that no inline function or
// template those headers define is compiled for AVX-512 and then picked by the
// linker for code that runs on a CPU without it); dispatch.cc calls them only
// where cpuid reports AVX-512 F, BW, VL and VNNI.

#ifdef QARRAY_EMULATE_AVX512  // test builds only: SIMDe's AVX-512 on AVX2, no target below
#include "tests/avx512_emulation.h"
#else
#include <immintrin.h>
#endif

#include "common.h"

#ifndef QARRAY_EMULATE_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

#define QARRAY_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#else
#define QARRAY_AVX512
#endif

namespace qarray::cpu::avx512 {

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
  static void StoreU8(uint8_t* p, F a) {
    // shifted to unsigned for vpdpbusd: q + 128 in [1, 255]
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

#include "quantize_row.h"

constexpr int kRowBlock = 4;  // rows of x per pass over the weights
constexpr int64_t kKnChunk = 128;  // weight rows per partial sum (layout kn)

// v = x[row] * fold (fold: null or K scales) quantized: float levels, u8
// levels + 128 (for vpdpbusd), or both
inline float QuantizeRow(const float* x, const float* fold, int64_t k, float* out_float,
                         uint8_t* out_u8) {
  return QuantizeRowT<VecAvx512>(x, fold, k, RowOut{out_float, nullptr, out_u8});
}

// `parts` u8 rows (levels + 128) a row of x (times fold), ks apart
inline void SplitRows(const float* x, const float* fold, int64_t m, int64_t k, int64_t ks,
                      int parts, uint8_t* xq, float* sx) {
  SplitRowsT<VecAvx512>(x, fold, m, k, ks, parts, nullptr, xq, sx);
}

// --- layout nk: y[m, n] = sum_k x[m, k] q[n, k], a dot product per (m, n)

// The weight rows of the next tile, a cache line each, while this tile is
// computed: each row of a large matrix starts a new page, where the hardware
// prefetchers stop (a hint: an address past the end does not fault).
template <int ROWS>
inline void Prefetch(const int8_t* p, int64_t stride) {
  for (int c = 0; c < ROWS; ++c) _mm_prefetch((const char*)(p + c * stride), _MM_HINT_T0);
}

QARRAY_AVX512 inline __m512 Widen16(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

template <int MB>
QARRAY_AVX512 void NkFloatBlock(const float* x, int64_t k, const int8_t* q,
                                const float* scale, int64_t n0, int64_t n1,
                                float* y, int64_t n_total) {
  constexpr int NB = 4;
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    __m512 acc[MB][NB];
    for (int r = 0; r < MB; ++r)
      for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
      __mmask16 m = (k - i >= 16) ? 0xFFFF : (__mmask16)((1u << (k - i)) - 1);
      if ((i & 63) == 0) Prefetch<NB>(q + (n + 2 * NB) * k + i, k);
      __m512 w[NB];
      for (int c = 0; c < NB; ++c) w[c] = Widen16(q + (n + c) * k + i, m);
      for (int r = 0; r < MB; ++r) {
        __m512 xv = _mm512_maskz_loadu_ps(m, x + r * k + i);
        for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_fmadd_ps(xv, w[c], acc[r][c]);
      }
    }
    for (int r = 0; r < MB; ++r)
      for (int c = 0; c < NB; ++c)
        y[r * n_total + n + c] = _mm512_reduce_add_ps(acc[r][c]) * scale[n + c];
  }
  for (; n < n1; ++n) {
    __m512 acc[MB];
    for (int r = 0; r < MB; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
      __mmask16 m = (k - i >= 16) ? 0xFFFF : (__mmask16)((1u << (k - i)) - 1);
      __m512 w = Widen16(q + n * k + i, m);
      for (int r = 0; r < MB; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + r * k + i), w, acc[r]);
    }
    for (int r = 0; r < MB; ++r)
      y[r * n_total + n] = _mm512_reduce_add_ps(acc[r]) * scale[n];
  }
}

// u8 rows xq (k bytes each, k_stride apart), s8 weights: integer dot
// products of MB rows with NB output channels from n (NB a constant, so that
// the accumulators live in registers)
template <int MB, int NB>
QARRAY_AVX512 inline void NkInt8Tile(const uint8_t* xq, int64_t k_stride,
                                     const float* sx, int64_t k, const int8_t* q,
                                     const float* scale, int64_t n, float* y,
                                     int64_t n_total) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i acc[MB][NB], rowsum[NB];
  for (int c = 0; c < NB; ++c) {
    rowsum[c] = _mm512_setzero_si512();
    for (int r = 0; r < MB; ++r) acc[r][c] = _mm512_setzero_si512();
  }
  for (int64_t i = 0; i < k; i += 64) {
    const __mmask64 m = (k - i >= 64) ? ~0ULL : ((1ULL << (k - i)) - 1);
    Prefetch<NB>(q + (n + 2 * NB) * k + i, k);
    __m512i w[NB];
    for (int c = 0; c < NB; ++c) {
      w[c] = _mm512_maskz_loadu_epi8(m, q + (n + c) * k + i);
      rowsum[c] = _mm512_dpbusd_epi32(rowsum[c], ones, w[c]);
    }
    for (int r = 0; r < MB; ++r) {
      const __m512i xv = _mm512_maskz_loadu_epi8(m, xq + r * k_stride + i);
      for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], xv, w[c]);
    }
  }
  for (int c = 0; c < NB; ++c) {
    const int64_t correction = 128LL * _mm512_reduce_add_epi32(rowsum[c]);
    for (int r = 0; r < MB; ++r) {
      const int64_t dot = _mm512_reduce_add_epi32(acc[r][c]) - correction;
      y[r * n_total + n + c] = (float)dot * sx[r] * scale[n + c];
    }
  }
}

template <int MB>
QARRAY_AVX512 void NkInt8Block(const uint8_t* xq, int64_t k_stride,
                               const float* sx, int64_t k, const int8_t* q,
                               const float* scale, int64_t n0, int64_t n1,
                               float* y, int64_t n_total) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4)
    NkInt8Tile<MB, 4>(xq, k_stride, sx, k, q, scale, n, y, n_total);
  for (; n < n1; ++n) NkInt8Tile<MB, 1>(xq, k_stride, sx, k, q, scale, n, y, n_total);
}


// --- layout nk, many rows: a GEMM on weights repacked per chunk
//
// From gemm_rows rows (W8A8, or weight-only's int8 parts) each chunk of
// output channels first copies its weights into vpdpbusd's layout: 16
// channels x 4 consecutive k per 64-byte vector (k padded to 4 with zeros),
// with 128 * rowsum per channel. Then kGemmMR rows x 32 channels accumulate
// in registers, 4 bytes of a row broadcast against two weight vectors: no
// horizontal sums (what the dot-product tiles above spend most on at many
// rows), and each weight vector serves kGemmMR rows from L1/L2.
// from 8 int8 rows the GEMM is ahead of the dot-product tiles and XLA's int8
// dots (make bench, suite kernels --strategies; _kernels.KERNEL_GEMM_ROWS)
constexpr int kGemmMR = 8;

struct Panel {
  std::vector<int8_t> w;       // (n16 + 1) blocks of k4 x 64 bytes
  std::vector<int32_t> corr;   // 128 * rowsum, per channel of the chunk
  int64_t k4 = 0;
};

// acc[r][0..1] += `steps` groups of 4 bytes of MR u8 rows (x + r * rs, 4
// bytes a step) broadcast against two weight vectors a step (w0, w1: 64
// bytes a step): the inner loop every GEMM tile below shares
template <int MR>
QARRAY_AVX512 inline void DotSteps(__m512i (&acc)[MR][2], const uint8_t* x, int64_t rs,
                                   const int8_t* w0, const int8_t* w1, int64_t steps) {
  for (int64_t g = 0; g < steps; ++g) {
    const __m512i a = _mm512_loadu_si512(w0 + g * 64);
    const __m512i b = _mm512_loadu_si512(w1 + g * 64);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * rs + 4 * g, 4);
      const __m512i xb = _mm512_set1_epi32(four);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xb, a);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xb, b);
    }
  }
}

// the masks of a tile's two blocks of 16 channels, `cols` of 32 real
struct ColumnMasks {
  __mmask16 lo, hi;
  explicit ColumnMasks(int64_t cols)
      : lo(cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1)),
        hi(cols >= 32 ? 0xFFFF
                      : (cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1))) {}
};

// 128 * the per-lane byte sums of `steps` 64-byte vectors of a panel block
// (lane c: channel c's weights), what the u8 shift of x subtracts
QARRAY_AVX512 inline __m512i PanelSums(const int8_t* block, int64_t steps) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t g = 0; g < steps; ++g)
    sum = _mm512_dpbusd_epi32(sum, ones, _mm512_loadu_si512(block + g * 64));
  return _mm512_mullo_epi32(sum, _mm512_set1_epi32(128));
}

// 16 vectors of 16 int32 lanes, transposed in place (lane e of r[c] becomes
// lane c of r[e]): each lane here is 4 consecutive bytes of a weight row
QARRAY_AVX512 inline void Transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + j]: element 4 L + j of rows i..i+3
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

QARRAY_AVX512 void PackPanel(const int8_t* q, int64_t k, int64_t n0, int64_t n1,
                             Panel& panel) {
  const int64_t k4 = (k + 3) / 4, n16 = (n1 - n0 + 15) / 16;
  panel.k4 = k4;
  // one zero block more: the last pair of vectors may hold one real one
  panel.w.assign((n16 + 1) * k4 * 64, 0);
  panel.corr.assign((n16 + 1) * 16, 0);
  for (int64_t b = 0; b < n16; ++b) {
    const int64_t lanes = std::min<int64_t>(16, n1 - n0 - 16 * b);
    const int8_t* rows = q + (n0 + 16 * b) * k;
    int8_t* dst = panel.w.data() + b * k4 * 64;
    for (int64_t i = 0; i < k; i += 64) {  // 16 groups of 4 k at a time
      const __mmask64 m = (k - i >= 64) ? ~0ULL : ((1ULL << (k - i)) - 1);
      __m512i r[16];
      for (int c = 0; c < 16; ++c)
        r[c] = c < lanes ? _mm512_maskz_loadu_epi8(m, rows + c * k + i)
                         : _mm512_setzero_si512();
      Transpose16(r);
      const int64_t groups = std::min<int64_t>(16, k4 - i / 4);
      for (int64_t e = 0; e < groups; ++e) _mm512_storeu_si512(dst + (i / 4 + e) * 64, r[e]);
    }
    _mm512_storeu_si512(panel.corr.data() + 16 * b, PanelSums(dst, k4));
  }
}

// The same panel from layout kn's q[K, N] (row-major, N apart): four rows'
// 16 bytes interleaved byte by byte into one 64-byte vector per 4 k
QARRAY_AVX512 void PackPanelKn(const int8_t* q, int64_t k, int64_t n, int64_t n0,
                               int64_t n1, Panel& panel) {
  const int64_t k4 = (k + 3) / 4, n16 = (n1 - n0 + 15) / 16;
  panel.k4 = k4;
  panel.w.assign((n16 + 1) * k4 * 64, 0);
  panel.corr.assign((n16 + 1) * 16, 0);
  // four rows at a time across the chunk's columns: each row read in order
  // (a block of 16 columns down all K rows would touch a page per row)
  for (int64_t g = 0; g < k4; ++g) {
    for (int64_t b = 0; b < n16; ++b) {
      const int64_t c0 = n0 + 16 * b, lanes = std::min<int64_t>(16, n1 - c0);
      const __mmask16 m = lanes == 16 ? 0xFFFF : (__mmask16)((1u << lanes) - 1);
      __m128i r[4];
      for (int t = 0; t < 4; ++t)
        r[t] = 4 * g + t < k ? _mm_maskz_loadu_epi8(m, q + (4 * g + t) * n + c0)
                             : _mm_setzero_si128();
      const __m128i ab_lo = _mm_unpacklo_epi8(r[0], r[1]);
      const __m128i ab_hi = _mm_unpackhi_epi8(r[0], r[1]);
      const __m128i cd_lo = _mm_unpacklo_epi8(r[2], r[3]);
      const __m128i cd_hi = _mm_unpackhi_epi8(r[2], r[3]);
      __m512i v = _mm512_castsi128_si512(_mm_unpacklo_epi16(ab_lo, cd_lo));
      v = _mm512_inserti32x4(v, _mm_unpackhi_epi16(ab_lo, cd_lo), 1);
      v = _mm512_inserti32x4(v, _mm_unpacklo_epi16(ab_hi, cd_hi), 2);
      v = _mm512_inserti32x4(v, _mm_unpackhi_epi16(ab_hi, cd_hi), 3);
      _mm512_storeu_si512(panel.w.data() + (b * k4 + g) * 64, v);
    }
  }
  for (int64_t b = 0; b < n16; ++b)  // the sums, from the panel (in L2)
    _mm512_storeu_si512(panel.corr.data() + 16 * b,
                        PanelSums(panel.w.data() + b * k4 * 64, k4));
}

// MR rows of u8 xq (ks bytes apart) times the panel's 32 channels from c
// (two blocks of 16): the integer products, the u8 shift's correction taken off
template <int MR>
QARRAY_AVX512 inline void PanelProducts(const uint8_t* xq, int64_t ks, const Panel& panel,
                                        int64_t c, __m512i (&acc)[MR][2]) {
  const int64_t k4 = panel.k4;
  const int8_t* w0 = panel.w.data() + (c / 16) * k4 * 64;
  const int8_t* w1 = w0 + k4 * 64;
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  DotSteps<MR>(acc, xq, ks, w0, w1, k4);
  const __m512i c0 = _mm512_loadu_si512(panel.corr.data() + c);
  const __m512i c1 = _mm512_loadu_si512(panel.corr.data() + c + 16);
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = _mm512_sub_epi32(acc[r][0], c0);
    acc[r][1] = _mm512_sub_epi32(acc[r][1], c1);
  }
}

// PanelProducts, `cols` of the 32 real, into y (ldy apart), scaled
template <int MR>
QARRAY_AVX512 void GemmTile(const uint8_t* xq, int64_t ks, const float* sx,
                            const Panel& panel, int64_t c, int64_t cols,
                            const float* scale, float* y, int64_t ldy) {
  __m512i acc[MR][2];
  PanelProducts<MR>(xq, ks, panel, c, acc);
  const ColumnMasks m(cols);
  const __m512 s0 = _mm512_maskz_loadu_ps(m.lo, scale);
  const __m512 s1 = _mm512_maskz_loadu_ps(m.hi, scale + 16);
  for (int r = 0; r < MR; ++r) {
    const __m512 x = _mm512_set1_ps(sx[r]);
    const __m512 y0 = _mm512_cvtepi32_ps(acc[r][0]);
    const __m512 y1 = _mm512_cvtepi32_ps(acc[r][1]);
    _mm512_mask_storeu_ps(y + r * ldy, m.lo, _mm512_mul_ps(_mm512_mul_ps(y0, x), s0));
    _mm512_mask_storeu_ps(y + r * ldy + 16, m.hi, _mm512_mul_ps(_mm512_mul_ps(y1, x), s1));
  }
}

// PanelProducts, `cols` of the 32 real, added into sums (ld apart): one block
// of K of layout kn's GEMM
template <int MR>
QARRAY_AVX512 void GemmTileSums(const uint8_t* xq, int64_t ks, const Panel& panel,
                                int64_t c, int64_t cols, int32_t* sums, int64_t ld) {
  __m512i acc[MR][2];
  PanelProducts<MR>(xq, ks, panel, c, acc);
  const ColumnMasks m(cols);
  for (int r = 0; r < MR; ++r) {
    int32_t* at = sums + r * ld;
    _mm512_mask_storeu_epi32(
        at, m.lo, _mm512_add_epi32(_mm512_maskz_loadu_epi32(m.lo, at), acc[r][0]));
    _mm512_mask_storeu_epi32(
        at + 16, m.hi, _mm512_add_epi32(_mm512_maskz_loadu_epi32(m.hi, at + 16), acc[r][1]));
  }
}

// --- layout kn: y[m, n] = sum_k v[m, k] q[k, n], 64 output columns at a time

// MB rows and NB groups of 16 columns from n, the last group masked
template <int MB, int NB>
QARRAY_AVX512 inline void KnFloatTile(const float* x, const float* fold, int64_t k,
                                      const int8_t* q, int64_t n, __mmask16 last,
                                      float* y, int64_t n_total) {
  // two-level sums: a fresh accumulator per kKnChunk rows of the weights,
  // added into y, so rounding grows with kKnChunk + k / kKnChunk, not k
  __m512 total[MB][NB];
  for (int r = 0; r < MB; ++r)
    for (int c = 0; c < NB; ++c) total[r][c] = _mm512_setzero_ps();
  for (int64_t i0 = 0; i0 < k; i0 += kKnChunk) {
    const int64_t i1 = std::min(i0 + kKnChunk, k);
    __m512 acc[MB][NB];
    for (int r = 0; r < MB; ++r)
      for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = i0; i < i1; ++i) {
      const int8_t* row = q + i * n_total + n;
      __m512 w[NB];
      for (int c = 0; c < NB; ++c)
        w[c] = Widen16(row + 16 * c, c == NB - 1 ? last : (__mmask16)0xFFFF);
      const float f = fold ? fold[i] : 1.0f;
      for (int r = 0; r < MB; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * k + i] * f);
        for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_fmadd_ps(xv, w[c], acc[r][c]);
      }
    }
    for (int r = 0; r < MB; ++r)
      for (int c = 0; c < NB; ++c) total[r][c] = _mm512_add_ps(total[r][c], acc[r][c]);
  }
  for (int r = 0; r < MB; ++r)
    for (int c = 0; c < NB; ++c)
      _mm512_mask_storeu_ps(y + r * n_total + n + 16 * c,
                            c == NB - 1 ? last : (__mmask16)0xFFFF, total[r][c]);
}

template <int MB>
QARRAY_AVX512 void KnFloatBlock(const float* x, const float* fold, int64_t k,
                                const int8_t* q, int64_t n0, int64_t n1,
                                float* y, int64_t n_total) {
  int64_t n = n0;
  if (MB <= 2) {
    for (; n + 64 <= n1; n += 64)
      KnFloatTile<MB, 4>(x, fold, k, q, n, 0xFFFF, y, n_total);
  } else {
    for (; n + 32 <= n1; n += 32)
      KnFloatTile<MB, 2>(x, fold, k, q, n, 0xFFFF, y, n_total);
  }
  for (; n < n1; n += 16) {
    const int64_t left = n1 - n;
    const __mmask16 m = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
    KnFloatTile<MB, 1>(x, fold, k, q, n, m, y, n_total);
  }
}


// --- the handler: rows in blocks, output channels in chunks over threads

struct Problem {
  int64_t m, k, n;
  bool kn, int8;
  // weight-only nk runs as W8A8 on each row of x split in `split` int8 parts,
  // each quantizing what the previous left (x to ~1e-7 of its row's largest
  // entry: float32 precision): integer dot products of rows = split * m,
  // summed into y at the end
  bool split = false;
  int64_t rows = 0;
  std::vector<float> y_parts;
  const float* x;
  const int8_t* q;
  const float* scale;
  float* y;
  // int8 activations: quantized rows (u8 for nk, float for kn) and scales
  std::vector<uint8_t> xq;
  std::vector<float> xf, sx;
  int64_t k_stride = 0;  // bytes between rows of xq (nk): k rounded up to 4
  bool gemm = false;  // gemm_rows rows (parts) or more: GemmChunk
  int64_t parts = 3, gemm_rows = 8;  // Thresholds: split parts, GEMM rows
};

template <int MB>
QARRAY_AVX512 void RunBlock(const Problem& p, int64_t row, int64_t n0, int64_t n1) {
  float* y = p.y + row * p.n;
  if (p.split) {
    NkInt8Block<MB>(p.xq.data() + row * p.k_stride, p.k_stride, p.sx.data() + row,
                    p.k, p.q, p.scale, n0, n1,
                    const_cast<float*>(p.y_parts.data()) + row * p.n, p.n);
  } else if (!p.kn && !p.int8) {
    NkFloatBlock<MB>(p.x + row * p.k, p.k, p.q, p.scale, n0, n1, y, p.n);
  } else if (!p.kn) {
    NkInt8Block<MB>(p.xq.data() + row * p.k_stride, p.k_stride, p.sx.data() + row,
                    p.k, p.q, p.scale, n0, n1, y, p.n);
  } else {
    // folded (and quantized) rows; a few rows run in KnDotProduct instead
    KnFloatBlock<MB>(p.xf.data() + row * p.k, nullptr, p.k, p.q, n0, n1, y, p.n);
  }
  if (p.kn && p.int8) {
    for (int r = 0; r < MB; ++r)
      for (int64_t j = n0; j < n1; ++j) y[r * p.n + j] *= p.sx[row + r];
  }
}

// The dot-product tiles over channels [n0, n1): output channels in tiles
// whose weights (tile x K int8) stay in L2 while every block of rows passes
// over them, so the weights are read from memory once.
QARRAY_AVX512 void RunTiles(const Problem& p, int64_t n0, int64_t n1) {
  // nk: tiles of output channels that stay in L2 (four at a time, in L1,
  // measured no better); kn: strips of 64 columns down every row
  int64_t tile = std::clamp<int64_t>((131072 / p.k) / 4 * 4, 4, 256);
  if (p.kn) tile = 64;
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(t0 + tile, n1);
    int64_t row = 0;
    for (; row + kRowBlock <= p.rows; row += kRowBlock)
      RunBlock<kRowBlock>(p, row, t0, t1);
    switch (p.rows - row) {
      case 3: RunBlock<3>(p, row, t0, t1); break;
      case 2: RunBlock<2>(p, row, t0, t1); break;
      case 1: RunBlock<1>(p, row, t0, t1); break;
      default: break;
    }
  }
}

// Layout nk, one panel's channels [n0, n1): packed, then tiles of rows x 32
QARRAY_AVX512 void GemmPanel(const Problem& p, int64_t n0, int64_t n1, int64_t r0,
                             int64_t r1) {
  Panel panel;
  PackPanel(p.q, p.k, n0, n1, panel);
  float* y = p.split ? const_cast<float*>(p.y_parts.data()) : p.y;
  // a block of rows stays in L1 while it passes over the whole panel (in L2)
  auto rows = [&](auto mr, int64_t row) {
    constexpr int MR = decltype(mr)::value;
    for (int64_t c = 0; c < n1 - n0; c += 32)
      GemmTile<MR>(p.xq.data() + row * p.k_stride, p.k_stride, p.sx.data() + row,
                   panel, c, std::min<int64_t>(32, n1 - n0 - c), p.scale + n0 + c,
                   y + row * p.n + n0 + c, p.n);
  };
  int64_t row = r0;
  for (; row + kGemmMR <= r1; row += kGemmMR)
    rows(std::integral_constant<int, kGemmMR>{}, row);
  for (; row < r1; ++row) rows(std::integral_constant<int, 1>{}, row);
}

// Layout kn over channels [n0, n1): the panel's rows of q are N apart, so it
// is packed a block of K at a time across the whole chunk (each row read
// along (n1 - n0) bytes; a narrow panel down all of K touched a page per 64
// bytes: make bench, suite kernels, the kn rows), the integer sums carried
// across the blocks in int32 (exact, as one block), then scaled
QARRAY_AVX512 void GemmChunkKn(const Problem& p, int64_t n0, int64_t n1, int64_t r0,
                               int64_t r1) {
  const int64_t width = n1 - n0;
  const int64_t block = std::max<int64_t>(4, kPanelBytes / width / 4 * 4);
  std::vector<int32_t> sums((r1 - r0) * width, 0);
  Panel panel;
  for (int64_t k0 = 0; k0 < p.k; k0 += block) {
    PackPanelKn(p.q + k0 * p.n, std::min(block, p.k - k0), p.n, n0, n1, panel);
    auto rows = [&](auto mr, int64_t row) {
      constexpr int MR = decltype(mr)::value;
      for (int64_t c = 0; c < width; c += 32)
        GemmTileSums<MR>(p.xq.data() + row * p.k_stride + k0, p.k_stride, panel, c,
                         std::min<int64_t>(32, width - c),
                         sums.data() + (row - r0) * width + c, width);
    };
    int64_t row = r0;
    for (; row + kGemmMR <= r1; row += kGemmMR)
      rows(std::integral_constant<int, kGemmMR>{}, row);
    for (; row < r1; ++row) rows(std::integral_constant<int, 1>{}, row);
  }
  // kn: the weights' scales folded into x already
  float* y = p.split ? const_cast<float*>(p.y_parts.data()) : p.y;
  for (int64_t row = r0; row < r1; ++row)
    for (int64_t j = 0; j < width; ++j)
      y[row * p.n + n0 + j] = static_cast<float>(sums[(row - r0) * width + j]) * p.sx[row];
}

// The GEMM form over channels [n0, n1): panels of at most kPanelBytes, each
// packed then multiplied while it is in L2 (one panel of a whole chunk, 2 MiB
// at K = 4096, went to memory and back: make bench, suite kernels, the
// (16, 4096, 4096) rows)
QARRAY_AVX512 void GemmChunk(const Problem& p, int64_t n0, int64_t n1, int64_t r0,
                             int64_t r1) {
  if (p.kn) return GemmChunkKn(p, n0, n1, r0, r1);
  const int64_t step = std::max<int64_t>(32, kPanelBytes / std::max<int64_t>(p.k, 1) / 32 * 32);
  for (int64_t c = n0; c < n1; c += step) GemmPanel(p, c, std::min(n1, c + step), r0, r1);
}

// y's rows [r0, r1) / split, channels [n0, n1): the parts' products summed
QARRAY_AVX512 void SumParts(const Problem& p, int64_t n0, int64_t n1, int64_t r0,
                            int64_t r1) {
  for (int64_t r = r0 / p.parts; r < r1 / p.parts; ++r)
    for (int64_t j = n0; j < n1; ++j) {
      float sum = 0.0f;
      for (int part = 0; part < p.parts; ++part)
        sum += p.y_parts[(p.parts * r + part) * p.n + j];
      p.y[r * p.n + j] = sum;
    }
}

QARRAY_AVX512 void RunChunk(const Problem& p, int64_t n0, int64_t n1) {
  if (p.gemm) {
    GemmChunk(p, n0, n1, 0, p.rows);
  } else {
    RunTiles(p, n0, n1);
  }
  if (p.split) SumParts(p, n0, n1, 0, p.rows);
}

QARRAY_AVX512 void Prepare(Problem& p) {
  p.rows = p.m;
  // u8 rows 4-byte aligned for the GEMM's broadcasts (the padding meets zero
  // weights there, and the tiles never read it)
  p.k_stride = (p.k + 3) / 4 * 4;
  // the GEMM from gemm_rows int8 rows (weight-only: split parts a row);
  // weight-only runs on split rows for nk, and for kn under the GEMM
  p.gemm = (p.int8 ? p.m : p.parts * p.m) >= p.gemm_rows;
  p.split = !p.int8 && (!p.kn || p.gemm);
  if (p.split) {
    p.rows = p.parts * p.m;
    p.xq.assign(p.rows * p.k_stride, 0);
    p.sx.resize(p.rows);
    p.y_parts.resize(p.rows * p.n);
    SplitRows(p.x, p.kn ? p.scale : nullptr, p.m, p.k, p.k_stride, static_cast<int>(p.parts), p.xq.data(),
              p.sx.data());
    return;
  }
  if (p.kn && !p.int8) {  // the scales fold into x once: v = x * scale
    p.xf.resize(p.m * p.k);
    for (int64_t r = 0; r < p.m; ++r)
      for (int64_t i = 0; i < p.k; ++i) p.xf[r * p.k + i] = p.x[r * p.k + i] * p.scale[i];
    return;
  }
  if (!p.int8) return;
  p.sx.resize(p.m);
  if (p.kn && !p.gemm) {
    p.xf.resize(p.m * p.k);
    for (int64_t r = 0; r < p.m; ++r)
      p.sx[r] = QuantizeRow(p.x + r * p.k, p.scale, p.k, p.xf.data() + r * p.k, nullptr);
  } else {  // u8 rows (kn: of x * scale)
    p.xq.assign(p.m * p.k_stride, 0);
    const float* fold = p.kn ? p.scale : nullptr;
    for (int64_t r = 0; r < p.m; ++r)
      p.sx[r] = QuantizeRow(p.x + r * p.k, fold, p.k, nullptr,
                            p.xq.data() + r * p.k_stride);
  }
}

// --- layout kn with a few rows (Thresholds::kn_dot_rows int8 rows at most): integer
// products.
// Each row of x (times the scales, which fold in for kn) becomes int8 rows:
// one (W8A8) or `split` parts (weight-only, float32-exact as for nk). Four
// weight rows at a time are interleaved in registers into vpdpbusd's
// four-byte groups (two unpacks of bytes, two of words, per 256 weights),
// the weights made unsigned by flipping their sign bit (q + 128, corrected
// by 128 * sum(x) per row), against broadcasts of four entries of each x row.
// The unpacks leave the columns in a fixed order inside each 64-column block
// (KnDotColumn), restored when the sums are read. Threads take contiguous
// ranges of weight rows, so each streams its share of memory in order, and
// their partial sums are added at the end (make bench, suite kernels, the
// matmul_q rows with few rows).

// int8 rows (parts of x's rows) at most: past 9 the sums (rows x N int32)
// spill out of L2's reach and XLA's int8 dot measured faster at N = 4096
// (W8A8 (12, 4096, 4096): 1.25x of float32 against 1.96x; make bench, suite
// kernels, the kn rows)

// where column `off` of a 64-column block sits among its four accumulators
// (e: which unpack, lane L: which 16 columns, t: which of four)
inline int64_t KnDotColumn(int64_t off) {
  return 16 * ((off % 16) / 4) + 4 * (off / 16) + off % 4;
}

struct KnDotProblem {
  int64_t m, k, n, ks, rows, width;  // rows: int8 rows (parts); width: n to 64
  int parts;
  const int8_t* q;
  float* y;
  std::vector<int8_t> xs;  // rows x ks signed levels, zero past k
  std::vector<float> sx;   // their scales
  std::vector<int32_t> acc;  // per range: rows x width sums, block order
  std::vector<int64_t> xsum;  // per range: rows' sums of levels
  int64_t step = 0, ranges = 0;
};

// four weight rows from `row` (rows past K meet zero entries of x: any
// readable row serves), columns [j, j + 64) masked by m, as vpdpbusd's
// unsigned four-byte groups in KnDotColumn's order
QARRAY_AVX512 inline void KnDotQuads(const int8_t* const* row, int64_t j, __mmask64 m,
                                     __m512i* w) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i r0 = _mm512_maskz_loadu_epi8(m, row[0] + j);
  const __m512i r1 = _mm512_maskz_loadu_epi8(m, row[1] + j);
  const __m512i r2 = _mm512_maskz_loadu_epi8(m, row[2] + j);
  const __m512i r3 = _mm512_maskz_loadu_epi8(m, row[3] + j);
  const __m512i lo01 = _mm512_unpacklo_epi8(r0, r1), hi01 = _mm512_unpackhi_epi8(r0, r1);
  const __m512i lo23 = _mm512_unpacklo_epi8(r2, r3), hi23 = _mm512_unpackhi_epi8(r2, r3);
  w[0] = _mm512_xor_si512(_mm512_unpacklo_epi16(lo01, lo23), flip);
  w[1] = _mm512_xor_si512(_mm512_unpackhi_epi16(lo01, lo23), flip);
  w[2] = _mm512_xor_si512(_mm512_unpacklo_epi16(hi01, hi23), flip);
  w[3] = _mm512_xor_si512(_mm512_unpackhi_epi16(hi01, hi23), flip);
}

// weight rows [k0, k1) into acc (rows x width) and xsum, for R int8 rows;
// S groups of four weight rows per pass over the sums (a load and a store of
// each sum per 4 * S rows)
template <int R, int S>
QARRAY_AVX512 void KnDotRange(const KnDotProblem& p, int64_t k0, int64_t k1,
                              int32_t* acc, int64_t* xsum) {
  const int64_t blocks = p.width / 64;
  std::fill(acc, acc + R * p.width, 0);
  for (int r = 0; r < R; ++r) {
    int64_t sum = 0;
    for (int64_t i = k0; i < k1; ++i) sum += p.xs[r * p.ks + i];
    xsum[r] = sum;
  }
  for (int64_t i = k0; i < k1; i += 4 * S) {
    const int8_t* row[4 * S];
    for (int u = 0; u < 4 * S; ++u) row[u] = p.q + std::min(i + u, p.k - 1) * p.n;
    __m512i xv[S][R];
    for (int g = 0; g < S; ++g)
      for (int r = 0; r < R; ++r)  // past k1: x is zero to ks, then unread rows
        xv[g][r] = i + 4 * g < p.ks ? _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(
                                          p.xs.data() + r * p.ks + i + 4 * g))
                                    : _mm512_setzero_si512();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t j = 64 * b;
      const __mmask64 m = p.n - j >= 64 ? ~0ull : ((1ull << (p.n - j)) - 1);
      for (int u = 0; u < 4 * S; ++u)  // two passes ahead: from memory in time
        _mm_prefetch(reinterpret_cast<const char*>(row[u] + 8 * S * p.n + j), _MM_HINT_T0);
      __m512i w[S][4];
      for (int g = 0; g < S; ++g) KnDotQuads(row + 4 * g, j, m, w[g]);
      for (int r = 0; r < R; ++r) {
        int32_t* at = acc + r * p.width + j;
        for (int e = 0; e < 4; ++e) {
          __m512i sum = _mm512_loadu_si512(at + 16 * e);
          for (int g = 0; g < S; ++g) sum = _mm512_dpbusd_epi32(sum, w[g][e], xv[g][r]);
          _mm512_storeu_si512(at + 16 * e, sum);
        }
      }
    }
  }
}

// the int8 rows KnDotRun computes for `rows` (the next instantiated count)
inline int64_t KnDotRows(int64_t rows) {
  static_assert(kMaxKnDotRows == 9, "KnDotRun instantiates counts up to kMaxKnDotRows");
  for (int64_t r : {1, 2, 3, 4, 6, 8, 9})
    if (rows <= r) return r;
  return -1;
}

QARRAY_AVX512 void KnDotRun(const KnDotProblem& p, int64_t c) {
  const int64_t k0 = c * p.step, k1 = std::min(k0 + p.step, p.k);
  int32_t* acc = const_cast<int32_t*>(p.acc.data()) + c * p.rows * p.width;
  int64_t* xsum = const_cast<int64_t*>(p.xsum.data()) + c * p.rows;
  switch (p.rows) {
    // eight weight rows a pass while the broadcasts of x fit in registers
    case 1: KnDotRange<1, 2>(p, k0, k1, acc, xsum); break;
    case 2: KnDotRange<2, 2>(p, k0, k1, acc, xsum); break;
    case 3: KnDotRange<3, 2>(p, k0, k1, acc, xsum); break;
    case 4: KnDotRange<4, 2>(p, k0, k1, acc, xsum); break;
    case 6: KnDotRange<6, 2>(p, k0, k1, acc, xsum); break;
    case 8: KnDotRange<8, 1>(p, k0, k1, acc, xsum); break;
    case 9: KnDotRange<9, 1>(p, k0, k1, acc, xsum); break;
    default: break;
  }
}

QARRAY_AVX512 void KnDotProduct(Pool& pool, const float* x,
                                const float* scale, int64_t threads,
                                std::shared_ptr<KnDotProblem> p) {
  p->ks = (p->k + 3) / 4 * 4;
  p->width = (p->n + 63) / 64 * 64;
  p->rows = KnDotRows(p->parts * p->m);  // rows past parts * m: zeros
  p->xs.assign(p->rows * p->ks, 0);
  p->sx.assign(p->rows, 0.0f);
  std::vector<uint8_t> u8(p->rows * p->ks, 128);
  if (p->parts == 1) {
    for (int64_t r = 0; r < p->m; ++r)
      p->sx[r] = QuantizeRow(x + r * p->k, scale, p->k, nullptr, u8.data() + r * p->ks);
  } else {
    SplitRows(x, scale, p->m, p->k, p->ks, p->parts, u8.data(), p->sx.data());
  }
  for (int64_t r = 0; r < p->rows; ++r)  // u8 (level + 128) -> the level
    for (int64_t i = 0; i < p->k; ++i)
      p->xs[r * p->ks + i] = static_cast<int8_t>(u8[r * p->ks + i] ^ 0x80);
  // contiguous ranges of weight rows, a multiple of 8 long
  const int64_t span = (p->k + threads - 1) / threads;
  p->step = (span + 7) / 8 * 8;
  p->ranges = (p->k + p->step - 1) / p->step;
  p->acc.resize(p->ranges * p->rows * p->width);
  p->xsum.resize(p->ranges * p->rows);
  const KnDotProblem* problem = p.get();
  Parallel(pool, p->ranges, 1, threads,
           [problem](int64_t c0, int64_t c1) {
             for (int64_t c = c0; c < c1; ++c) KnDotRun(*problem, c);
           },
           p);
  for (int64_t r = 0; r < p->m; ++r)
    for (int64_t j = 0; j < p->n; ++j) {
      const int64_t at = j / 64 * 64 + KnDotColumn(j % 64);
      float sum = 0.0f;
      for (int part = 0; part < p->parts; ++part) {
        const int64_t row = p->parts * r + part;
        int64_t total = 0;
        for (int64_t c = 0; c < p->ranges; ++c)
          total += p->acc[(c * p->rows + row) * p->width + at] - 128 * p->xsum[c * p->rows + row];
        sum += p->sx[row] * static_cast<float>(total);
      }
      p->y[r * p->n + j] = sum;
    }
}

void Product(Pool& pool, const ProductArgs& a) {
  auto p = std::make_shared<Problem>();
  p->m = a.m;
  p->k = a.k;
  p->n = a.n;
  p->kn = a.kn;
  p->int8 = a.int8;
  p->parts = a.t.split;
  p->gemm_rows = a.t.gemm_rows;
  p->x = a.x;
  p->q = a.q;
  p->scale = a.scale;
  p->y = a.y;
  if (p->m == 0 || p->n == 0) return;
  if (p->k == 0) {
    std::memset(p->y, 0, sizeof(float) * p->m * p->n);
    return;
  }
  // small products stay on the calling thread: waking the pool's threads
  // costs more than their share of the work (make bench, suite kernels); a
  // few rows stream their weights from memory, which two threads read faster
  // than one from a quarter of that work on (the M = 1 rows, weights cold)
  const int64_t work_bytes = p->m * p->k * p->n;
  const int64_t parallel_from = p->m <= kRowBlock ? kParallelWork / 4 : kParallelWork;
  const int64_t threads =
      work_bytes < parallel_from ? 1 : std::max<int64_t>(1, pool.num_threads());
  if (p->kn && p->m * (p->int8 ? 1 : p->parts) <= a.t.kn_dot_rows) {
    auto dot = std::make_shared<KnDotProblem>();
    dot->m = p->m;
    dot->k = p->k;
    dot->n = p->n;
    dot->parts = p->int8 ? 1 : static_cast<int>(p->parts);
    dot->q = p->q;
    dot->y = p->y;
    KnDotProduct(pool, p->x, p->scale, threads, dot);
    return;
  }
  Prepare(*p);
  const Problem* problem = p.get();  // ~4 chunks per thread
  Parallel(pool, p->n, ChunkSize(p->n, threads, 4), threads,
           [problem](int64_t n0, int64_t n1) { RunChunk(*problem, n0, n1); }, p);
}

// --- int4 weights, layout nk: q[N, K / 2] (two values a byte as 4-bit two's
// complement, the low nibble holding the even k), scale[N, K / G]:
//   y[m, n] = sum_g scale[n, g] * sum_{k in group g} x[m, k] w[n, k]
// Weight-only, float32 sums: each byte's nibbles widened in registers (the
// high one by an arithmetic shift of the sign-extended byte, the low one by
// shifting it to the top first) against x's even and odd entries, which are
// split apart once per call, so no nibble is ever interleaved.

struct Int4Problem {
  int64_t m, k, n, group;  // group: values per scale, a multiple of 32
  // int8 parts per row of x: split (weight-only, float32-exact) or 1 (W4A8:
  // x quantized per row)
  int parts;
  const float* x;
  const uint8_t* q;
  const float* scale;
  float* y;
  std::vector<float> xe, xo;  // x's even and odd entries, (m, k / 2) each
  // the GEMM (Thresholds::int4_gemm_rows rows and more): u8 rows (or parts) of x (k apart),
  // their scales, and the parts' products
  std::vector<uint8_t> xq;
  std::vector<float> sx, y_parts;
};

constexpr int kInt4RowBlock = 8;  // rows of x per pass over int4 weights

// MB rows from `row` times channels [n0, n1), over the groups [g0, g1),
// added to y. Each nibble becomes its float value times the group's scale in
// one permute of a 16-entry table (the 4-bit two's complement values, scaled
// once per group), so the sums need no per-group pass.
template <int MB>
QARRAY_AVX512 void Int4Block(const Int4Problem& p, int64_t row, int64_t n0,
                             int64_t n1, int64_t g0, int64_t g1) {
  const int64_t half = p.k / 2, groups = p.k / p.group, group_bytes = p.group / 2;
  const float* xe = p.xe.data() + row * half;
  const float* xo = p.xo.data() + row * half;
  const __m512 values =
      _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  for (int64_t j = n0; j < n1; ++j) {
    const uint8_t* q = p.q + j * half;
    const float* s = p.scale + j * groups;
    // even and odd sums apart: two dependency chains per row
    __m512 sum[MB], odd[MB];
    for (int r = 0; r < MB; ++r) sum[r] = odd[r] = _mm512_setzero_ps();
    for (int64_t g = g0; g < g1; ++g) {
      const __m512 table = _mm512_mul_ps(values, _mm512_set1_ps(s[g]));
      for (int64_t b = g * group_bytes; b < (g + 1) * group_bytes; b += 16) {
        // the same bytes of the row 4 channels on (a hint: an address past
        // the end does not fault), far enough ahead to come from memory in time
        if ((b & 63) == 0)
          _mm_prefetch(reinterpret_cast<const char*>(q + b + 4 * half), _MM_HINT_T0);
        const __m512i bytes =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b)));
        // the permute reads the low 4 bits of each index
        const __m512 lo = _mm512_permutexvar_ps(bytes, table);
        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
#pragma GCC unroll 8
        for (int r = 0; r < MB; ++r) {
          sum[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xe + r * half + b), sum[r]);
          odd[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xo + r * half + b), odd[r]);
        }
      }
    }
    for (int r = 0; r < MB; ++r)
      p.y[(row + r) * p.n + j] += _mm512_reduce_add_ps(_mm512_add_ps(sum[r], odd[r]));
  }
}

// Channels in tiles whose packed weights stay in L2 while every block of
// rows passes over them; K in spans whose even and odd entries of a block of
// rows stay in L1 (one span: all of K, when a block's rows fit).
QARRAY_AVX512 void Int4Chunk(const Int4Problem& p, int64_t n0, int64_t n1) {
  const int64_t tile = std::clamp<int64_t>(262144 / p.k / 4 * 4, 4, 256);
  const int64_t groups = p.k / p.group;
  const int64_t rows = std::min<int64_t>(p.m, kInt4RowBlock);
  // 16 KB of x per span: rows * span * 4 bytes
  const int64_t span = std::max<int64_t>(1, 4096 / rows / p.group);  // groups
  for (int64_t r = 0; r < p.m; ++r)
    std::fill(p.y + r * p.n + n0, p.y + r * p.n + n1, 0.0f);
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(t0 + tile, n1);
    for (int64_t g0 = 0; g0 < groups; g0 += span) {
      const int64_t g1 = std::min(g0 + span, groups);
      int64_t row = 0;
      for (; row + kInt4RowBlock <= p.m; row += kInt4RowBlock)
        Int4Block<kInt4RowBlock>(p, row, t0, t1, g0, g1);
      switch (p.m - row) {
        case 7: Int4Block<7>(p, row, t0, t1, g0, g1); break;
        case 6: Int4Block<6>(p, row, t0, t1, g0, g1); break;
        case 5: Int4Block<5>(p, row, t0, t1, g0, g1); break;
        case 4: Int4Block<4>(p, row, t0, t1, g0, g1); break;
        case 3: Int4Block<3>(p, row, t0, t1, g0, g1); break;
        case 2: Int4Block<2>(p, row, t0, t1, g0, g1); break;
        case 1: Int4Block<1>(p, row, t0, t1, g0, g1); break;
        default: break;
      }
    }
  }
}


// --- int4 weights through the GEMM (from Thresholds::int4_gemm_rows rows of x):
// the nibbles become int8 in the panel, and each group's integer sums are
// scaled by the group's scale in the tile, in float32.
struct Int4Panel {
  std::vector<int8_t> w;      // (n16 + 1) blocks of k4 x 64 bytes, as Panel
  std::vector<int32_t> corr;  // 128 * rowsum per (block, group, lane)
  std::vector<float> sg;      // scale[n, g] per (block, group, lane)
  int64_t k4 = 0, groups = 0, g4 = 0;  // g4: steps of 4 k per group
};

// 32 packed bytes (fewer under m) -> their 64 int4 values as int8, k order
QARRAY_AVX512 inline __m512i Nibbles64(const uint8_t* q, __mmask32 m) {
  const __m512i table = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1));
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, q));
  const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(b, low4));
  const __m512i hi =
      _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(b, 4), low4));
  return _mm512_or_si512(lo, _mm512_slli_epi16(hi, 8));  // even k low, odd k high
}

QARRAY_AVX512 void PackInt4Panel(const uint8_t* q, const float* scale, int64_t k,
                                 int64_t group, int64_t n0, int64_t n1, Int4Panel& panel) {
  const int64_t k4 = k / 4, n16 = (n1 - n0 + 15) / 16, groups = k / group;
  panel.k4 = k4;
  panel.groups = groups;
  panel.g4 = group / 4;
  panel.w.assign((n16 + 1) * k4 * 64, 0);
  panel.corr.assign((n16 + 1) * groups * 16, 0);
  panel.sg.assign((n16 + 1) * groups * 16, 0.0f);
  for (int64_t b = 0; b < n16; ++b) {
    const int64_t lanes = std::min<int64_t>(16, n1 - n0 - 16 * b);
    int8_t* dst = panel.w.data() + b * k4 * 64;
    for (int64_t i = 0; i < k; i += 64) {
      const int64_t bytes = std::min<int64_t>(32, (k - i) / 2);
      const __mmask32 m = bytes == 32 ? ~0u : ((1u << bytes) - 1);
      __m512i r[16];
      for (int c = 0; c < 16; ++c)
        r[c] = c < lanes ? Nibbles64(q + (n0 + 16 * b + c) * (k / 2) + i / 2, m)
                         : _mm512_setzero_si512();
      Transpose16(r);
      const int64_t steps = std::min<int64_t>(16, k4 - i / 4);
      for (int64_t e = 0; e < steps; ++e) _mm512_storeu_si512(dst + (i / 4 + e) * 64, r[e]);
    }
    for (int64_t g = 0; g < groups; ++g) {
      _mm512_storeu_si512(panel.corr.data() + (b * groups + g) * 16,
                          PanelSums(dst + g * panel.g4 * 64, panel.g4));
      for (int64_t lane = 0; lane < lanes; ++lane)
        panel.sg[(b * groups + g) * 16 + lane] = scale[(n0 + 16 * b + lane) * groups + g];
    }
  }
}

template <int MR>
QARRAY_AVX512 void Int4GemmTile(const uint8_t* xq, int64_t ks, const float* sx,
                                const Int4Panel& panel, int64_t c, int64_t cols,
                                float* y, int64_t ldy) {
  const int64_t b0 = c / 16, k4 = panel.k4, groups = panel.groups;
  const int8_t* w0 = panel.w.data() + b0 * k4 * 64;
  const int8_t* w1 = w0 + k4 * 64;
  __m512 f[MR][2];
  for (int r = 0; r < MR; ++r) f[r][0] = f[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    const int64_t e = g * panel.g4;  // the group's first step of 4 k
    DotSteps<MR>(acc, xq + 4 * e, ks, w0 + e * 64, w1 + e * 64, panel.g4);
    const int64_t at0 = (b0 * groups + g) * 16, at1 = ((b0 + 1) * groups + g) * 16;
    const __m512i c0 = _mm512_loadu_si512(panel.corr.data() + at0);
    const __m512i c1 = _mm512_loadu_si512(panel.corr.data() + at1);
    const __m512 s0 = _mm512_loadu_ps(panel.sg.data() + at0);
    const __m512 s1 = _mm512_loadu_ps(panel.sg.data() + at1);
    for (int r = 0; r < MR; ++r) {
      f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][0], c0)), s0,
                                f[r][0]);
      f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][1], c1)), s1,
                                f[r][1]);
    }
  }
  const ColumnMasks m(cols);
  for (int r = 0; r < MR; ++r) {
    const __m512 x = _mm512_set1_ps(sx[r]);
    _mm512_mask_storeu_ps(y + r * ldy, m.lo, _mm512_mul_ps(f[r][0], x));
    _mm512_mask_storeu_ps(y + r * ldy + 16, m.hi, _mm512_mul_ps(f[r][1], x));
  }
}

constexpr int kInt4GemmMR = 4;

// channels [n0, n1) of the split rows' products, then the parts summed
QARRAY_AVX512 void Int4GemmPanel(const Int4Problem& p, int64_t n0, int64_t n1) {
  Int4Panel panel;
  PackInt4Panel(p.q, p.scale, p.k, p.group, n0, n1, panel);
  float* parts = const_cast<float*>(p.y_parts.data());
  const int64_t rows = p.parts * p.m;
  auto block = [&](auto mr, int64_t row) {
    constexpr int MR = decltype(mr)::value;
    for (int64_t c = 0; c < n1 - n0; c += 32)
      Int4GemmTile<MR>(p.xq.data() + row * p.k, p.k, p.sx.data() + row, panel, c,
                       std::min<int64_t>(32, n1 - n0 - c), parts + row * p.n + n0 + c,
                       p.n);
  };
  int64_t row = 0;
  for (; row + kInt4GemmMR <= rows; row += kInt4GemmMR)
    block(std::integral_constant<int, kInt4GemmMR>{}, row);
  for (; row < rows; ++row) block(std::integral_constant<int, 1>{}, row);
  for (int64_t r = 0; r < p.m; ++r)
    for (int64_t j = n0; j < n1; ++j) {
      float sum = 0.0f;
      for (int part = 0; part < p.parts; ++part)
        sum += parts[(p.parts * r + part) * p.n + j];
      p.y[r * p.n + j] = sum;
    }
}

// channels [n0, n1) in panels that stay in L2, as GemmChunk
QARRAY_AVX512 void Int4GemmChunk(const Int4Problem& p, int64_t n0, int64_t n1) {
  const int64_t step = std::max<int64_t>(32, kPanelBytes / std::max<int64_t>(p.k, 1) / 32 * 32);
  for (int64_t c = n0; c < n1; c += step) Int4GemmPanel(p, c, std::min(n1, c + step));
}

void ProductInt4(Pool& pool, const Int4Args& a) {
  auto p = std::make_shared<Int4Problem>();
  p->m = a.m;
  p->k = a.k;
  p->n = a.n;
  p->group = a.group;
  p->x = a.x;
  p->q = a.q;
  p->scale = a.scale;
  p->y = a.y;
  const bool int8 = a.int8;
  if (p->m == 0 || p->n == 0) return;
  const int64_t threads = p->m * p->k * p->n < kParallelWork
                              ? 1
                              : std::max<int64_t>(1, pool.num_threads());
  const Int4Problem* problem = p.get();
  p->parts = int8 ? 1 : static_cast<int>(a.t.split);
  if (p->m >= a.t.int4_gemm_rows) {
    const int64_t rows = p->parts * p->m;
    p->xq.assign(rows * p->k, 0);
    p->sx.resize(rows);
    p->y_parts.resize(rows * p->n);
    if (int8)
      for (int64_t r = 0; r < p->m; ++r)
        p->sx[r] = QuantizeRow(p->x + r * p->k, nullptr, p->k, nullptr,
                               p->xq.data() + r * p->k);
    else
      SplitRows(p->x, nullptr, p->m, p->k, p->k, p->parts, p->xq.data(), p->sx.data());
    Parallel(pool, p->n, ChunkSize(p->n, threads, 4), threads,
             [problem](int64_t n0, int64_t n1) { Int4GemmChunk(*problem, n0, n1); }, p);
    return;
  }
  // a few rows: float32 tiles, on x itself or (W4A8) on its int8 levels
  // times their scale, the same products the GEMM's integer sums give
  const int64_t half = p->k / 2;
  p->xe.resize(p->m * half);
  p->xo.resize(p->m * half);
  std::vector<float> levels(int8 ? p->k : 0);
  for (int64_t r = 0; r < p->m; ++r) {
    const float* row = p->x + r * p->k;
    if (int8) {
      const float sx = QuantizeRow(row, nullptr, p->k, levels.data(), nullptr);
      for (float& v : levels) v *= sx;
      row = levels.data();
    }
    for (int64_t i = 0; i < half; ++i) {
      p->xe[r * half + i] = row[2 * i];
      p->xo[r * half + i] = row[2 * i + 1];
    }
  }
  Parallel(pool, p->n, ChunkSize(p->n, threads, 4), threads,
           [problem](int64_t n0, int64_t n1) { Int4Chunk(*problem, n0, n1); }, p);
}


// 16 rows of 16 bytes transposed in place: r[j] byte i becomes r[i] byte j
QARRAY_AVX512 inline void Transpose16Bytes(__m128i r[16]) {
  __m128i a[16], b[16], c[16];
  for (int i = 0; i < 8; ++i) {  // 16-bit units: rows 2i, 2i + 1 at one column
    a[2 * i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i)  // 32-bit units: rows 4i .. 4i + 3
    for (int h = 0; h < 2; ++h) {
      b[4 * i + 2 * h] = _mm_unpacklo_epi16(a[4 * i + h], a[4 * i + 2 + h]);
      b[4 * i + 2 * h + 1] = _mm_unpackhi_epi16(a[4 * i + h], a[4 * i + 2 + h]);
    }
  // b[4i + t] holds columns 4t .. 4t + 3 of rows 4i .. 4i + 3
  for (int i = 0; i < 2; ++i)  // 64-bit units: rows 8i .. 8i + 7
    for (int t = 0; t < 4; ++t) {
      c[8 * i + 2 * t] = _mm_unpacklo_epi32(b[8 * i + t], b[8 * i + 4 + t]);
      c[8 * i + 2 * t + 1] = _mm_unpackhi_epi32(b[8 * i + t], b[8 * i + 4 + t]);
    }
  // c[8i + u] holds columns 2u, 2u + 1 of rows 8i .. 8i + 7
  for (int u = 0; u < 8; ++u) {
    r[2 * u] = _mm_unpacklo_epi64(c[u], c[8 + u]);
    r[2 * u + 1] = _mm_unpackhi_epi64(c[u], c[8 + u]);
  }
}

// 8 rows of 8 floats transposed in place
QARRAY_AVX512 inline void Transpose8Floats(__m256 r[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    s[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(s[i], s[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(s[i], s[4 + i], 0x31);
  }
}

// --- conv_q on CPU: an implicit GEMM over a padded channels-last copy of x
//
// x f32[B, C, *S] (1-3 spatial axes, channels first), q s8[O, C/G * prod(k)]
// (one row per output channel, (C/G, *k) flattened), scale f32[O] ->
// y f32[B, O, *S']. Each example is quantized as one row (W8A8: one scale per
// example, conv_q's numerics) or split in `split` int8 parts (weight-only),
// and written channels last, as u8 (v + 128), inside a border of 128s (the
// zero padding). For each kernel offset, kGemmMR consecutive output positions
// of a line read kGemmMR rows of C bytes a fixed stride apart, so the GEMM's
// tile runs on that buffer directly, offset after offset, with the weights
// packed offset-major (no im2col copy).
struct ConvProblem {
  ConvGeometry g;
  int64_t batch, channels, cpad, cg, cg4, og, out_channels, parts, positions;
  int64_t offsets, plane;  // kernel offsets; padded positions of an example
  std::vector<uint8_t> xc;  // (parts * batch, *padded, cpad)
  std::vector<float> sx;    // per example part
  Panel panel;              // one group's weights, k = offsets * cg4
  const float* scale;
};

// one group's weights (og rows of cg * offsets, channel-major) repacked
// offset-major with the channels padded to cg4: row o, entry (off, c)
QARRAY_AVX512 void PackConvPanel(const int8_t* q, const ConvProblem& c, Panel& panel) {
  const int64_t k = c.offsets * c.cg4;
  std::vector<int8_t> rows(c.og * k, 0);
  for (int64_t o = 0; o < c.og; ++o)
    for (int64_t ch = 0; ch < c.cg; ++ch)
      for (int64_t off = 0; off < c.offsets; ++off)
        rows[o * k + off * c.cg4 + ch] = q[(o * c.cg + ch) * c.offsets + off];
  PackPanel(rows.data(), k, 0, c.og, panel);
}

// kGemmMR (or MR) output positions from (e, line, o2) times the panel's 32
// channels from col: offsets outer, the channels of each in steps of 4
template <int MR>
QARRAY_AVX512 void ConvTile(const ConvProblem& c, int64_t e, int64_t o0, int64_t o1,
                            int64_t o2, int64_t c0, int64_t col, int64_t cols,
                            float* y, bool add) {
  const ConvGeometry& g = c.g;
  const Panel& panel = c.panel;
  const int8_t* w0 = panel.w.data() + (col / 16) * panel.k4 * 64;
  const int8_t* w1 = w0 + panel.k4 * 64;
  const int64_t row_step = g.stride[2] * c.cpad, c4 = c.cg4 / 4;
  __m512i acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  const uint8_t* xe = c.xc.data() + e * c.plane * c.cpad + c0;
  int64_t step = 0;
  for (int64_t i0 = 0; i0 < g.k[0]; ++i0)
    for (int64_t i1 = 0; i1 < g.k[1]; ++i1)
      for (int64_t i2 = 0; i2 < g.k[2]; ++i2) {
        const int64_t p0 = o0 * g.stride[0] + i0 * g.dilation[0];
        const int64_t p1 = o1 * g.stride[1] + i1 * g.dilation[1];
        const int64_t p2 = o2 * g.stride[2] + i2 * g.dilation[2];
        const uint8_t* x = xe + ((p0 * g.padded[1] + p1) * g.padded[2] + p2) * c.cpad;
        DotSteps<MR>(acc, x, row_step, w0 + step * 64, w1 + step * 64, c4);
        step += c4;
      }
  const ColumnMasks m(cols);
  const __m512i k0 = _mm512_loadu_si512(panel.corr.data() + col);
  const __m512i k1 = _mm512_loadu_si512(panel.corr.data() + col + 16);
  const __m512 s0 = _mm512_maskz_loadu_ps(m.lo, c.scale + col);
  const __m512 s1 = _mm512_maskz_loadu_ps(m.hi, c.scale + col + 16);
  const __m512 sx = _mm512_set1_ps(c.sx[e]);
  // rows of 32 channels, then written channel by channel (MR positions
  // each) into y's (channels, positions) layout; the parts after the first add
  alignas(64) float tile[MR][32];
  for (int r = 0; r < MR; ++r) {
    const __m512 y0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][0], k0));
    const __m512 y1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][1], k1));
    _mm512_store_ps(tile[r], _mm512_mul_ps(_mm512_mul_ps(y0, sx), s0));
    _mm512_store_ps(tile[r] + 16, _mm512_mul_ps(_mm512_mul_ps(y1, sx), s1));
  }
  if constexpr (MR == 8) {  // 8 x 8 blocks transposed in registers
    for (int64_t b = 0; b < cols; b += 8) {
      __m256 block[8];
      for (int r = 0; r < 8; ++r) block[r] = _mm256_load_ps(tile[r] + b);
      Transpose8Floats(block);
      for (int64_t j = b; j < std::min<int64_t>(cols, b + 8); ++j) {
        float* dst = y + (col + j) * c.positions;
        const __m256 v = block[j - b];
        _mm256_storeu_ps(dst, add ? _mm256_add_ps(_mm256_loadu_ps(dst), v) : v);
      }
    }
    return;
  }
  for (int64_t j = 0; j < cols; ++j) {
    float* dst = y + (col + j) * c.positions;
    for (int r = 0; r < MR; ++r) dst[r] = add ? dst[r] + tile[r][j] : tile[r][j];
  }
}

// lines [l0, l1) of all examples (a line: fixed o0, o1; all of o2), each
// example's parts in turn, into out (batch, out_channels, positions) at the
// group's channels
QARRAY_AVX512 void ConvLines(const ConvProblem& c, int64_t gi, int64_t l0, int64_t l1,
                             float* out) {
  const ConvGeometry& g = c.g;
  const int64_t lines = g.out[0] * g.out[1], c0 = gi * c.cg;
  for (int64_t l = l0; l < l1; ++l) {
    const int64_t b = l / lines, line = l % lines, o0 = line / g.out[1],
                  o1 = line % g.out[1];
    float* y = out + (b * c.out_channels + gi * c.og) * c.positions + line * g.out[2];
    for (int64_t part = 0; part < c.parts; ++part) {
      const int64_t e = b * c.parts + part;
      int64_t o2 = 0;
      for (; o2 + kGemmMR <= g.out[2]; o2 += kGemmMR)
        for (int64_t col = 0; col < c.og; col += 32)
          ConvTile<kGemmMR>(c, e, o0, o1, o2, c0, col,
                            std::min<int64_t>(32, c.og - col), y + o2, part > 0);
      for (; o2 < g.out[2]; ++o2)
        for (int64_t col = 0; col < c.og; col += 32)
          ConvTile<1>(c, e, o0, o1, o2, c0, col, std::min<int64_t>(32, c.og - col),
                      y + o2, part > 0);
    }
  }
}

// One example's u8 levels (C, *S) written channels last into its padded
// plane (rows of cpad bytes), 16 channels x 16 positions of a line at a time
// through a byte transpose in registers (a byte at a time, this copy took
// about a fifth of the PointNet row: make bench, suite conv)
QARRAY_AVX512 void ChannelsLast(const ConvProblem& c, const uint8_t* src, uint8_t* base) {
  const ConvGeometry& g = c.g;
  const int64_t plane_in = g.in[0] * g.in[1] * g.in[2], n2 = g.in[2];
  for (int64_t p0 = 0; p0 < g.in[0]; ++p0)
    for (int64_t p1 = 0; p1 < g.in[1]; ++p1) {
      const uint8_t* line = src + (p0 * g.in[1] + p1) * n2;
      uint8_t* dst = base + (((p0 + g.pad[0]) * g.padded[1] + p1 + g.pad[1]) * g.padded[2] +
                             g.pad[2]) * c.cpad;
      for (int64_t ch = 0; ch < c.channels; ch += 16) {
        const int64_t chs = std::min<int64_t>(16, c.channels - ch);
        const __mmask16 keep = static_cast<__mmask16>((1u << chs) - 1);
        for (int64_t p2 = 0; p2 < n2; p2 += 16) {
          const int64_t ps = std::min<int64_t>(16, n2 - p2);
          const __mmask16 take = static_cast<__mmask16>((1u << ps) - 1);
          __m128i r[16];
          for (int t = 0; t < 16; ++t)
            r[t] = t < chs ? _mm_maskz_loadu_epi8(take, line + (ch + t) * plane_in + p2)
                           : _mm_setzero_si128();
          Transpose16Bytes(r);
          for (int64_t j = 0; j < ps; ++j)
            _mm_mask_storeu_epi8(dst + (p2 + j) * c.cpad + ch, keep, r[j]);
        }
      }
    }
}

void Conv(Pool& pool, const ConvArgs& a) {
  auto c = std::make_shared<ConvProblem>();
  ConvGeometry& g = c->g;
  g = a.g;
  c->batch = a.batch;
  c->channels = a.channels;
  c->out_channels = a.out_channels;
  c->cg = c->channels / g.groups;
  c->og = c->out_channels / g.groups;
  c->offsets = g.k[0] * g.k[1] * g.k[2];
  const bool int8 = a.int8;
  c->cg4 = (c->cg + 3) / 4 * 4;
  c->cpad = c->channels + 4;  // a group's last 4 bytes stay inside the row
  c->positions = g.out[0] * g.out[1] * g.out[2];
  c->plane = g.padded[0] * g.padded[1] * g.padded[2];
  c->parts = int8 ? 1 : a.t.split;
  float* out = a.y;
  if (c->batch == 0 || c->positions == 0 || c->out_channels == 0)
    return;
  // each example quantized (or split) as one row, then channels last inside
  // its border of 128s: examples over the threads
  const int64_t plane_in = g.in[0] * g.in[1] * g.in[2], example = c->channels * plane_in;
  const int64_t examples = c->parts * c->batch;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  c->sx.resize(examples);
  c->xc.assign(examples * c->plane * c->cpad, 128);
  {
    ConvProblem* problem = c.get();
    const float* xs = a.x;
    Parallel(pool, c->batch, 1, example < 4096 ? 1 : threads,
             [problem, xs, example, plane_in](int64_t b0, int64_t b1) {
               ConvProblem& c = *problem;
               const ConvGeometry& g = c.g;
               std::vector<uint8_t> xq(c.parts * example);
               for (int64_t b = b0; b < b1; ++b) {
                 if (c.parts == 1)
                   c.sx[b] = QuantizeRow(xs + b * example, nullptr, example, nullptr,
                                         xq.data());
                 else
                   SplitRows(xs + b * example, nullptr, 1, example, example,
                             static_cast<int>(c.parts), xq.data(), c.sx.data() + b * c.parts);
                 for (int64_t part = 0; part < c.parts; ++part)
                   ChannelsLast(c, xq.data() + part * example,
                                c.xc.data() + (b * c.parts + part) * c.plane * c.cpad);
               }
             },
             c);
  }
  const int64_t lines = c->batch * g.out[0] * g.out[1];
  const int64_t work = examples * c->positions * c->og * c->offsets * c->cg4;
  const int64_t gemm_threads = work < kParallelWork ? 1 : threads;
  const int64_t per_chunk = std::max<int64_t>(1, lines / (4 * gemm_threads));
  for (int64_t gi = 0; gi < g.groups; ++gi) {
    PackConvPanel(a.q + gi * c->og * c->cg * c->offsets, *c, c->panel);
    c->scale = a.scale + gi * c->og;
    const ConvProblem* problem = c.get();
    Parallel(pool, lines, per_chunk, gemm_threads,
             [problem, gi, out](int64_t l0, int64_t l1) {
               ConvLines(*problem, gi, l0, l1, out);
             },
             c);
  }
}

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
