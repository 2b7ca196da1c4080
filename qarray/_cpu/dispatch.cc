// The one dispatch point: which instruction set's tiles run, chosen once, at
// the first call, from the CPU's features (x86: cpuid; aarch64: the kernel's
// hwcaps) and QARRAY_CPU_ISA, which may force a lower one than the best
// (tests and benchmarks): amx | avx512 | avx2 on x86-64, i8mm | dotprod on
// aarch64.
#include <cstdlib>
#include <string>

#include "common.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#elif defined(__aarch64__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
#endif

namespace qarray::cpu {

#if defined(__x86_64__)
extern const Isa kAmx, kAvx512, kAvxVnni, kAvx2;
#elif defined(__aarch64__)
extern const Isa kI8mm, kDotprod;
#endif

namespace {

struct Choice {
  const Isa* isa = nullptr;
  std::string reason;
};

#if defined(__x86_64__)
bool HasAvxVnni() {  // cpuid leaf 7, subleaf 1: EAX bit 4
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  return (a >> 4) & 1;
}

// AMX-TILE and AMX-INT8 (cpuid leaf 7, subleaf 0: EDX bits 24 and 25), and
// Linux's permission to use the tile data (asked once for the process:
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); a kernel before 5.16,
// or one that refuses, leaves the tiles off)
bool AmxPermitted() {
  static const bool permitted = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}
#endif

// the instruction sets this CPU runs, best first
std::vector<const Isa*> Supported() {
  std::vector<const Isa*> out;
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#ifdef QARRAY_EMULATE_AMX
  // test builds only (scripts/test_kernels.sh amx-emulated): the AMX tiles
  // over tests/amx_emulation.h's intrinsics, wherever AVX2 runs
  if (avx2) out.push_back(&kAmx);
#else
  if (avx2 && AmxPermitted()) out.push_back(&kAmx);
#endif
#ifdef QARRAY_EMULATE_AVX512
  // test builds only (make test-kernels-avx512-emulated): the AVX-512 tiles are
  // compiled over SIMDe's emulation on AVX2, so they run wherever AVX2 does
  if (avx2) out.push_back(&kAvx512);
#else
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    out.push_back(&kAvx512);
#endif
  // AVX-VNNI (Alder Lake and later, Zen 4/5): the same tiles with vpdpbusd
  if (avx2 && HasAvxVnni()) out.push_back(&kAvxVnni);
  if (avx2) out.push_back(&kAvx2);
#elif defined(__aarch64__)
  const unsigned long hwcap = getauxval(AT_HWCAP), hwcap2 = getauxval(AT_HWCAP2);
  const bool dotprod = hwcap & HWCAP_ASIMDDP;
  if (dotprod && (hwcap2 & HWCAP2_I8MM)) out.push_back(&kI8mm);
  if (dotprod) out.push_back(&kDotprod);
#endif
  return out;
}

std::string Names(const std::vector<const Isa*>& isas) {
  std::string s;
  for (const Isa* isa : isas) s += (s.empty() ? "" : ", ") + std::string(isa->name);
  return s.empty() ? "none" : s;
}

Choice Choose() {
  const std::vector<const Isa*> supported = Supported();
  const char* forced = std::getenv("QARRAY_CPU_ISA");
  if (!forced || !*forced) {
    if (supported.empty())
#if defined(__x86_64__)
      return {nullptr, "this CPU lacks AVX2 and FMA"};
#elif defined(__aarch64__)
      return {nullptr, "this CPU lacks the dot-product instructions (ARMv8.2 dotprod)"};
#else
      return {nullptr, "no tiles for this architecture"};
#endif
    return {supported.front(), ""};
  }
  for (const Isa* isa : supported)
    if (std::string(forced) == isa->name) return {isa, ""};
  return {nullptr, "QARRAY_CPU_ISA=" + std::string(forced) +
                       " is not among this CPU's instruction sets (" + Names(supported) +
                       ")"};
}

const Choice& Chosen() {
  static const Choice choice = Choose();
  return choice;
}

}  // namespace

const Isa* Active() { return Chosen().isa; }
const char* ActiveReason() { return Chosen().reason.c_str(); }

const Isa* Find(const char* name) {
  for (const Isa* isa : Supported())
    if (std::string(name) == isa->name) return isa;
  return nullptr;
}

const Isa* Below(const char* name) {
  const std::vector<const Isa*> supported = Supported();
  for (size_t i = 0; i + 1 < supported.size(); ++i)
    if (std::string(name) == supported[i]->name) return supported[i + 1];
  return nullptr;
}

}  // namespace qarray::cpu

// For qarray/_ffi.py (ctypes): the instruction set in use ("amx", "avx512",
// "avxvnni", "avx2", "i8mm", "dotprod"), or null with qarray_cpu_reason() saying why
// none runs
extern "C" __attribute__((visibility("default"))) const char* qarray_cpu_isa() {
  const qarray::cpu::Isa* isa = qarray::cpu::Active();
  return isa ? isa->name : nullptr;
}

extern "C" __attribute__((visibility("default"))) const char* qarray_cpu_reason() {
  return qarray::cpu::ActiveReason();
}

// The limits only the kernels know (common.h): qarray/_ffi.py reads them when
// it loads the library and refuses it where a rule of qarray/_rules.py asks
// for more, rather than let every call fail its thresholds check
extern "C" __attribute__((visibility("default"))) int64_t qarray_cpu_max_split() {
  return qarray::cpu::kMaxSplit;
}

extern "C" __attribute__((visibility("default"))) int64_t qarray_cpu_max_kn_dot_rows() {
  return qarray::cpu::kMaxKnDotRows;
}
