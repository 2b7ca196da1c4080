// qarray's aarch64 tiles: NEON sdot (ARMv8.2 dotprod: Graviton 2, Ampere
// Altra, Apple M1) and smmla (the i8mm extension: Graviton 3/4, Apple M2+,
// Neoverse V1/V2/N2), the handlers' arithmetic written once in gemm.h.
//
// sdot multiplies signed bytes by signed bytes into int32 lanes, four
// products a lane, with no saturation: x's levels and the weights go in as
// they are. One sdot per 16 multiply-adds (a block of 8 channels x 4 k is two
// sdot against four bytes of a row broadcast): 1/16 instruction per MAC.
// smmla multiplies a 2 x 8 by an 8 x 2 block of signed bytes into a 2 x 2
// block of int32: 32 multiply-adds per instruction, 1/32 per MAC, on two rows
// at a time (the panel's two steps of 4 k zipped into pairs of channels x 8 k,
// two zips per 4 channels and 8 k, shared by every pair of rows).
// `make test-kernels-arm` checks their results under qemu, whose timings
// mean nothing: their speed is benchmarks.bench_kernels --isa-table's on an
// aarch64 host.
//
// Compiled for any ARMv8-A: the target pragmas come after the shared headers
// (as in tiles_avx2.cc); dispatch.cc calls these only where the kernel's
// hwcaps report dotprod (and i8mm for kI8mm).

#include <arm_neon.h>

#include "common.h"

#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")

namespace qarray::cpu::dotprod {

// the vector type the row quantizer (quantize_row.h) runs on
struct VecNeon {
  static constexpr int W = 4;
  using F = float32x4_t;
  using M = uint32x4_t;
  static F Load(const float* p) { return vld1q_f32(p); }
  static F Set1(float v) { return vdupq_n_f32(v); }
  static F Zero() { return vdupq_n_f32(0.0f); }
  static F Mul(F a, F b) { return vmulq_f32(a, b); }
  static F Div(F a, F b) { return vdivq_f32(a, b); }
  static F Sub(F a, F b) { return vsubq_f32(a, b); }
  static F Abs(F a) { return vabsq_f32(a); }
  // a NaN lane may win here: rows with a NaN are told apart before the max is used
  static F Max(F a, F b) { return vmaxq_f32(a, b); }
  static F Min(F a, F b) { return vminq_f32(a, b); }
  static F Round(F a) { return vrndnq_f32(a); }  // to nearest, ties to even
  static M None() { return vdupq_n_u32(0); }
  static M Or(M a, M b) { return vorrq_u32(a, b); }
  static M Unord(F a, F b) { return vmvnq_u32(vandq_u32(vceqq_f32(a, a), vceqq_f32(b, b))); }
  static M Gt(F a, F b) { return vcgtq_f32(a, b); }
  static bool Any(M m) { return vmaxvq_u32(m) != 0; }
  static F Select(M m, F a, F b) { return vbslq_f32(m, a, b); }
  static float ReduceMax(F a) { return vmaxvq_f32(a); }
  static void StoreF(float* p, F a) { vst1q_f32(p, a); }
  // 4 levels in [-127, 127] -> 4 bytes
  static int8x8_t Narrow(F a) {
    const int16x4_t h = vmovn_s32(vcvtnq_s32_f32(a));
    return vmovn_s16(vcombine_s16(h, h));
  }
  static void StoreS8(int8_t* p, F a) {
    vst1_lane_s32(reinterpret_cast<int32_t*>(p), vreinterpret_s32_s8(Narrow(a)), 0);
  }
  static void StoreU8(uint8_t* p, F a) {  // level + 128: the sign bit flipped
    const int8x8_t b = veor_s8(Narrow(a), vdup_n_s8(-128));
    vst1_lane_s32(reinterpret_cast<int32_t*>(p), vreinterpret_s32_s8(b), 0);
  }
  static void StoreS8x4(int8_t* p, F a, F b, F c, F d, bool) {
    const int16x8_t ab = vcombine_s16(vmovn_s32(vcvtnq_s32_f32(a)), vmovn_s32(vcvtnq_s32_f32(b)));
    const int16x8_t cd = vcombine_s16(vmovn_s32(vcvtnq_s32_f32(c)), vmovn_s32(vcvtnq_s32_f32(d)));
    vst1q_s8(p, vcombine_s8(vmovn_s16(ab), vmovn_s16(cd)));
  }
  static void Fence() {}
};

// gemm.h's int8 tile operations with sdot; the packing in plain C++ (the
// compiler vectorizes what it can; it runs once per panel)
struct I8Dotprod {
  static constexpr int kLanes = 8, kXBias = 0, kTilePairs = 1;
  static constexpr bool kPairs = false, kDotPaths = true, kTransposes = false;
  static constexpr bool kPacksPairs = false;
  // gemm.h's GEMM tiles: 4 rows in registers, any K
  static constexpr int kTileRows = 4;
  static constexpr bool kWholeTiles = false, kOwnTile = false;
  static constexpr int64_t kStepAlign = 1;
  struct Scope {};
  using Acc = int32x4x2_t;
  struct W {
    int8x16_t lo, hi;  // channels 0-3 and 4-7, four k each
  };
  static Acc Zero() { return {vdupq_n_s32(0), vdupq_n_s32(0)}; }
  static W LoadW(const int8_t* p) { return {vld1q_s8(p), vld1q_s8(p + 16)}; }
  static void Dot(Acc& acc, const W& w, int32_t x4) {
    const int8x16_t x = vreinterpretq_s8_s32(vdupq_n_s32(x4));
    acc.val[0] = vdotq_s32(acc.val[0], w.lo, x);
    acc.val[1] = vdotq_s32(acc.val[1], w.hi, x);
  }
  static void Store(int32_t* p, Acc a) {
    vst1q_s32(p, a.val[0]);
    vst1q_s32(p + 4, a.val[1]);
  }
  static Acc LoadAcc(const int32_t* p) { return {vld1q_s32(p), vld1q_s32(p + 4)}; }
  static void ScaleInto(float* p, Acc a, const float* s, bool add) {
    for (int h = 0; h < 2; ++h) {
      const float32x4_t v = vmulq_f32(vcvtq_f32_s32(a.val[h]), vld1q_f32(s + 4 * h));
      vst1q_f32(p + 4 * h, add ? vaddq_f32(vld1q_f32(p + 4 * h), v) : v);
    }
  }
  static void DotVec(Acc& acc, const W& w, const int8_t* x) {
    acc.val[0] = vdotq_s32(acc.val[0], w.lo, vld1q_s8(x));
    acc.val[1] = vdotq_s32(acc.val[1], w.hi, vld1q_s8(x + 16));
  }
  static int32_t Sum(Acc a) { return vaddvq_s32(vaddq_s32(a.val[0], a.val[1])); }
  static void Prefetch(const int8_t* p) { __builtin_prefetch(p); }
  using FAcc = float32x4_t;
  static FAcc FZero() { return vdupq_n_f32(0.0f); }
  static FAcc FmaScaled(FAcc f, Acc a, float s) {
    return vfmaq_n_f32(f, vcvtq_f32_s32(vaddq_s32(a.val[0], a.val[1])), s);
  }
  static float FSum(FAcc f) { return vaddvq_f32(f); }
  // 16 packed bytes -> their 16 low nibbles' values (even k), then their
  // 16 high ones (odd k), as 4-bit two's complement
  static W LoadInt4W(const uint8_t* q) {
    const uint8x16_t b = vld1q_u8(q);
    const int8x16_t table = {0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1};
    return {vqtbl1q_s8(table, vandq_u8(b, vdupq_n_u8(0x0F))), vqtbl1q_s8(table, vshrq_n_u8(b, 4))};
  }
  static void PackNk8(const int8_t* rows, int64_t ld, int64_t k, int8_t* dst, int64_t stride) {
    for (int64_t g = 0; g < k / 4; ++g)
      for (int c = 0; c < 8; ++c) std::memcpy(dst + g * stride + 4 * c, rows + c * ld + 4 * g, 4);
  }
  static void KnQuads(const int8_t* const* r, int64_t j, int8_t (*out)[32]) {
    for (int col = 0; col < 32; ++col)
      for (int t = 0; t < 4; ++t) out[col / 8][4 * (col % 8) + t] = r[t][j + col];
  }
  static void Int4Row(const uint8_t* q, int8_t* out) {
    for (int b = 0; b < 16; ++b) {
      const int lo = q[b] & 0xF, hi = q[b] >> 4;
      out[2 * b] = static_cast<int8_t>(lo >= 8 ? lo - 16 : lo);
      out[2 * b + 1] = static_cast<int8_t>(hi >= 8 ? hi - 16 : hi);
    }
  }
};

using I = I8Dotprod;
#include "quantize_row.h"
#include "gemm.h"

void Product(Pool& pool, const ProductArgs& a) { ProductT<VecNeon>(pool, a); }
void ProductInt4(Pool& pool, const Int4Args& a) { ProductInt4T<VecNeon>(pool, a); }
void Conv(Pool& pool, const ConvArgs& a) { ConvT<VecNeon>(pool, a); }
void Quantize(Pool& pool, const QuantizeArgs& a) { QuantizeT<VecNeon>(pool, a); }

}  // namespace qarray::cpu::dotprod

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod+i8mm")

namespace qarray::cpu::i8mm {

using dotprod::VecNeon;

struct I8Mmla : dotprod::I8Dotprod {
  static constexpr bool kPairs = true;
  // acc[r][0..1] += `steps` steps of 4 k, rows two at a time: per pair of
  // steps, the panel's blocks zipped into pairs of channels x 8 k (b), the
  // two rows' 8 bytes side by side (a), smmla per pair of channels giving
  // [r0 c, r0 c', r1 c, r1 c']; an odd last step meets zeros
  template <int MR>
  static void PairSteps(Acc (&acc)[MR][2], const int8_t* x, int64_t xs, const int8_t* w0,
                        const int8_t* w1, int64_t steps) {
    for (int r = 0; r < MR; r += 2) {
      int32x4_t p[2][4];  // [block][pair of channels]
      for (auto& b : p)
        for (auto& v : b) v = vdupq_n_s32(0);
      for (int64_t g = 0; g < steps; g += 2) {
        const bool two = g + 1 < steps;
        int64_t a0 = 0, a1 = 0;
        std::memcpy(&a0, x + r * xs + 4 * g, two ? 8 : 4);
        std::memcpy(&a1, x + (r + 1) * xs + 4 * g, two ? 8 : 4);
        const int8x16_t a = vreinterpretq_s8_s64(vcombine_s64(vcreate_s64(a0), vcreate_s64(a1)));
        const int8_t* blocks[2] = {w0, w1};
        for (int b = 0; b < 2; ++b) {
          for (int h = 0; h < 2; ++h) {  // channels 4h .. 4h + 3
            const int32x4_t s0 = vreinterpretq_s32_s8(vld1q_s8(blocks[b] + g * kStepBytes + 16 * h));
            const int32x4_t s1 =
                two ? vreinterpretq_s32_s8(vld1q_s8(blocks[b] + (g + 1) * kStepBytes + 16 * h))
                    : vdupq_n_s32(0);
            const int8x16_t c01 = vreinterpretq_s8_s32(vzip1q_s32(s0, s1));
            const int8x16_t c23 = vreinterpretq_s8_s32(vzip2q_s32(s0, s1));
            p[b][2 * h] = vmmlaq_s32(p[b][2 * h], a, c01);
            p[b][2 * h + 1] = vmmlaq_s32(p[b][2 * h + 1], a, c23);
          }
        }
      }
      for (int b = 0; b < 2; ++b)
        for (int h = 0; h < 2; ++h) {  // [r0 c, r0 c', r1 c, r1 c'] x 2 -> rows
          const int64x2_t lo = vreinterpretq_s64_s32(p[b][2 * h]);
          const int64x2_t hi = vreinterpretq_s64_s32(p[b][2 * h + 1]);
          int32x4_t& row0 = h ? acc[r][b].val[1] : acc[r][b].val[0];
          int32x4_t& row1 = h ? acc[r + 1][b].val[1] : acc[r + 1][b].val[0];
          row0 = vaddq_s32(row0, vreinterpretq_s32_s64(vzip1q_s64(lo, hi)));
          row1 = vaddq_s32(row1, vreinterpretq_s32_s64(vzip2q_s64(lo, hi)));
        }
    }
  }
};

using I = I8Mmla;
#include "quantize_row.h"
#include "gemm.h"

void Product(Pool& pool, const ProductArgs& a) { ProductT<VecNeon>(pool, a); }
void ProductInt4(Pool& pool, const Int4Args& a) { ProductInt4T<VecNeon>(pool, a); }
void Conv(Pool& pool, const ConvArgs& a) { ConvT<VecNeon>(pool, a); }

}  // namespace qarray::cpu::i8mm

#pragma GCC pop_options

namespace qarray::cpu {
extern const Isa kDotprod = {"dotprod",         dotprod::Product, dotprod::ProductInt4,
                             dotprod::Conv,     dotprod::Quantize,
                             dotprod::QuantizeRowEntry<dotprod::VecNeon>};
extern const Isa kI8mm = {"i8mm",          i8mm::Product,     i8mm::ProductInt4,
                          i8mm::Conv,      dotprod::Quantize,
                          dotprod::QuantizeRowEntry<dotprod::VecNeon>};
}  // namespace qarray::cpu
