// qarray's AVX2 tiles (x86-64 without AVX-512: AMD Zen 2-4, Intel since
// Haswell; with AVX-VNNI's 256-bit vpdpbusd where cpuid reports it: Alder
// Lake and later, Zen 5), the handlers' arithmetic written once in gemm.h.
//
// int8 dot products without VNNI: vpmaddubsw multiplies unsigned by signed
// bytes and adds pairs into int16 with saturation, which u8 (x + 128) x s8
// would reach (255 * 127 * 2 > 32767). The weights' magnitudes are the
// unsigned operand instead and their signs move onto x (vpsignb): |w| <= 128
// and |x| <= 127 (qarray's levels), so a pair is at most 2 * 128 * 127 =
// 32512 and never saturates; vpmaddwd against ones widens the pairs to int32.
// Four instructions per 32 multiply-adds and row (sign, maddubs, maddwd, add);
// with AVX-VNNI two (sign, vpdpbusd), the magnitudes computed once per weight
// block and shared by every row of the tile.
//
// Compiled for any x86-64: the target pragmas below come after every shared
// header, so nothing those headers define is compiled for AVX2 (the linker
// could pick such a copy for code that runs without it); dispatch.cc calls
// these only where cpuid reports AVX2 and FMA (and AVX-VNNI for kAvxVnni).

#include <immintrin.h>

#include "common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace qarray::cpu::avx2 {

#include "tiles_avx2.h"

using I = I8Avx2;
#include "quantize_row.h"
#include "gemm.h"

void Product(Pool& pool, const ProductArgs& a) { ProductT<VecAvx2>(pool, a); }
void ProductInt4(Pool& pool, const Int4Args& a) { ProductInt4T<VecAvx2>(pool, a); }
void Conv(Pool& pool, const ConvArgs& a) { ConvT<VecAvx2>(pool, a); }
void Quantize(Pool& pool, const QuantizeArgs& a) { QuantizeT<VecAvx2>(pool, a); }

}  // namespace qarray::cpu::avx2

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")

namespace qarray::cpu::avx2vnni {

using avx2::VecAvx2;

struct I8AvxVnni : avx2::I8Avx2 {
  static void Dot(Acc& acc, const W& w, int32_t x4) {
    const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(x4), w.w);
    acc = _mm256_dpbusd_avx_epi32(acc, w.mag, x);
  }
  static void DotVec(Acc& acc, const W& w, const int8_t* x) {
    const __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)), w.w);
    acc = _mm256_dpbusd_avx_epi32(acc, w.mag, xs);
  }
};

using I = I8AvxVnni;
#include "quantize_row.h"
#include "gemm.h"

void Product(Pool& pool, const ProductArgs& a) { ProductT<VecAvx2>(pool, a); }
void ProductInt4(Pool& pool, const Int4Args& a) { ProductInt4T<VecAvx2>(pool, a); }
void Conv(Pool& pool, const ConvArgs& a) { ConvT<VecAvx2>(pool, a); }

}  // namespace qarray::cpu::avx2vnni

#pragma GCC pop_options

namespace qarray::cpu {
extern const Isa kAvx2 = {"avx2",           avx2::Product,  avx2::ProductInt4,
                          avx2::Conv,       avx2::Quantize,
                          avx2::QuantizeRowEntry<avx2::VecAvx2>};
// kAvx2's numerics, one instruction fewer per product
extern const Isa kAvxVnni = {"avxvnni",        avx2vnni::Product, avx2vnni::ProductInt4,
                             avx2vnni::Conv,   avx2::Quantize,
                             avx2::QuantizeRowEntry<avx2::VecAvx2>};
}  // namespace qarray::cpu
