// Test builds only (make test-kernels-avx512-emulated, scripts/test_kernels.sh
// avx512-emulated): the AVX-512 intrinsics of tiles_avx512.cc from SIMDe's portable
// implementations (Debian's libsimde-dev) over AVX2, so that the AVX-512 tiles run,
// slowly, on a CPU without AVX-512. tiles_avx512.cc includes this instead of
// <immintrin.h> where QARRAY_EMULATE_AVX512 is defined, which scripts/build_kernels.sh
// never does. Below: the intrinsics SIMDe 0.7 (Debian bookworm) lacks, element by
// element from Intel's definitions; a SIMDe that has one keeps its own.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

namespace qarray_avx512_emulation {

template <typename To, typename From>
inline To As(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "same size");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

template <typename T, int N>
struct Lanes {
  T v[N];
};

// masked loads (zero where the mask is clear, masked-off bytes never read) and stores
template <typename V, typename T, int N, typename Mask>
inline V MaskzLoad(Mask m, const void* p) {
  Lanes<T, N> out{};
  for (int i = 0; i < N; ++i)
    if ((m >> i) & 1) std::memcpy(&out.v[i], static_cast<const char*>(p) + i * sizeof(T), sizeof(T));
  return As<V>(out);
}
template <typename T, int N, typename V, typename Mask>
inline void MaskStore(void* p, Mask m, V a) {
  const auto in = As<Lanes<T, N>>(a);
  for (int i = 0; i < N; ++i)
    if ((m >> i) & 1) std::memcpy(static_cast<char*>(p) + i * sizeof(T), &in.v[i], sizeof(T));
}

// lane-wise conversions: N lanes of From (the first N of a) to N lanes of To
template <typename V, typename To, typename From, int N, typename A, typename F>
inline V Convert(A a, F f) {
  Lanes<From, sizeof(A) / sizeof(From)> in = As<Lanes<From, sizeof(A) / sizeof(From)>>(a);
  Lanes<To, N> out;
  for (int i = 0; i < N; ++i) out.v[i] = f(in.v[i]);
  return As<V>(out);
}

inline int32_t RoundToInt(float x) {  // vcvtps2dq under the default MXCSR
  if (!(x >= -2147483648.0f && x < 2147483648.0f)) return INT32_MIN;  // NaN, out of range
  return static_cast<int32_t>(std::nearbyint(x));
}

// the reductions in the order of GCC's avx512fintrin.h: halves of 256, then of 128
// bits, then lanes 0, 1 with lanes 2, 3, then lane 0 with lane 1 (max as vmaxps:
// a > b ? a : b)
template <typename T, typename Op>
inline T Reduce(const Lanes<T, 16>& l, Op op) {
  T h[8], q[4], t[2];
  for (int i = 0; i < 8; ++i) h[i] = op(l.v[8 + i], l.v[i]);
  for (int i = 0; i < 4; ++i) q[i] = op(h[4 + i], h[i]);
  for (int i = 0; i < 2; ++i) t[i] = op(q[i], q[2 + i]);
  return op(t[0], t[1]);
}

inline float ReduceAddPs(simde__m512 a) {
  return Reduce(As<Lanes<float, 16>>(a), [](float x, float y) { return x + y; });
}
inline float ReduceMaxPs(simde__m512 a) {
  return Reduce(As<Lanes<float, 16>>(a), [](float x, float y) { return x > y ? x : y; });
}
inline int ReduceAddEpi32(simde__m512i a) {
  return Reduce(As<Lanes<int32_t, 16>>(a), [](int32_t x, int32_t y) {
    return static_cast<int32_t>(static_cast<uint32_t>(x) + static_cast<uint32_t>(y));
  });
}

}  // namespace qarray_avx512_emulation

#define QARRAY_EMU qarray_avx512_emulation
#ifndef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps(a) QARRAY_EMU::ReduceAddPs(a)
#endif
#ifndef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps(a) QARRAY_EMU::ReduceMaxPs(a)
#endif
#ifndef _mm512_reduce_add_epi32
#define _mm512_reduce_add_epi32(a) QARRAY_EMU::ReduceAddEpi32(a)
#endif
#ifndef _mm_maskz_loadu_epi8
#define _mm_maskz_loadu_epi8(m, p) \
  QARRAY_EMU::MaskzLoad<simde__m128i, int8_t, 16>(static_cast<uint16_t>(m), (p))
#endif
#ifndef _mm256_maskz_loadu_epi8
#define _mm256_maskz_loadu_epi8(m, p) \
  QARRAY_EMU::MaskzLoad<simde__m256i, int8_t, 32>(static_cast<uint32_t>(m), (p))
#endif
#ifndef _mm512_maskz_loadu_epi8
#define _mm512_maskz_loadu_epi8(m, p) \
  QARRAY_EMU::MaskzLoad<simde__m512i, int8_t, 64>(static_cast<uint64_t>(m), (p))
#endif
#ifndef _mm512_maskz_loadu_epi32
#define _mm512_maskz_loadu_epi32(m, p) \
  QARRAY_EMU::MaskzLoad<simde__m512i, int32_t, 16>(static_cast<uint16_t>(m), (p))
#endif
#ifndef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(m, p) \
  QARRAY_EMU::MaskzLoad<simde__m512, float, 16>(static_cast<uint16_t>(m), (p))
#endif
#ifndef _mm_mask_storeu_epi8
#define _mm_mask_storeu_epi8(p, m, a) \
  QARRAY_EMU::MaskStore<int8_t, 16>((p), static_cast<uint16_t>(m), simde__m128i(a))
#endif
#ifndef _mm512_mask_storeu_epi32
#define _mm512_mask_storeu_epi32(p, m, a) \
  QARRAY_EMU::MaskStore<int32_t, 16>((p), static_cast<uint16_t>(m), simde__m512i(a))
#endif
#ifndef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, m, a) \
  QARRAY_EMU::MaskStore<float, 16>((p), static_cast<uint16_t>(m), simde__m512(a))
#endif
#ifndef _mm512_stream_si512
#define _mm512_stream_si512(p, a) simde_mm512_storeu_si512((p), (a))
#endif
#ifndef _mm512_cvtepi32_epi8  // vpmovdb: truncation
#define _mm512_cvtepi32_epi8(a)                                                     \
  QARRAY_EMU::Convert<simde__m128i, int8_t, int32_t, 16>(                          \
      simde__m512i(a), [](int32_t x) { return static_cast<int8_t>(x & 0xff); })
#endif
#ifndef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps(a)                               \
  QARRAY_EMU::Convert<simde__m512, float, int32_t, 16>( \
      simde__m512i(a), [](int32_t x) { return static_cast<float>(x); })
#endif
#ifndef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32(a) \
  QARRAY_EMU::Convert<simde__m512i, int32_t, float, 16>(simde__m512(a), QARRAY_EMU::RoundToInt)
#endif
#ifndef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32(a)                               \
  QARRAY_EMU::Convert<simde__m512i, int32_t, int8_t, 16>( \
      simde__m128i(a), [](int8_t x) { return static_cast<int32_t>(x); })
#endif
#ifndef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32(a)                                \
  QARRAY_EMU::Convert<simde__m512i, int32_t, uint8_t, 16>( \
      simde__m128i(a), [](uint8_t x) { return static_cast<int32_t>(x); })
#endif
#ifndef _mm512_cvtepu8_epi16
#define _mm512_cvtepu8_epi16(a)                                \
  QARRAY_EMU::Convert<simde__m512i, int16_t, uint8_t, 32>( \
      simde__m256i(a), [](uint8_t x) { return static_cast<int16_t>(x); })
#endif
