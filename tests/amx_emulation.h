// Test builds only (scripts/test_kernels.sh amx-emulated, part of make
// test-kernels on every x86-64 machine): the AMX intrinsics tiles_amx.cc uses,
// element by element as Intel's pseudo-code defines them, so that the AMX tiles
// run, slowly, on a CPU without AMX. tiles_amx.cc includes this instead of
// AMX's target where QARRAY_EMULATE_AMX is defined, which
// scripts/build_kernels.sh never does.
//
// What it checks: the tile configuration each tile is used with (palette 1,
// rows and bytes a row per tile), loads and stores with strides, and the
// dot-product instructions' arithmetic (four byte products summed into each
// int32, signed or unsigned per operand, wrapping as the hardware's does). What
// only hardware can: speed, the kernel's permission to use the tile state
// (arch_prctl), and that the real instructions agree with this reading of them.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace qarray_amx_emulation {

// _tile_loadconfig's 64 bytes: palette, start row, then bytes a row (16 x
// u16) and rows (16 x u8) of each tile
struct Config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(Config) == 64, "AMX's tile configuration is 64 bytes");

struct State {
  Config config{};
  bool configured = false;
  uint8_t tile[8][16][64];  // 8 tiles of at most 16 rows x 64 bytes
};

inline State& Tiles() {
  static thread_local State state;  // the tile state is a thread's, as on hardware
  return state;
}

// a use of tile t with a configuration that does not define it is a #UD
// fault on hardware: abort here
inline void Need(int t) {
  const State& s = Tiles();
  if (!s.configured || t < 0 || t > 7 || s.config.rows[t] == 0 || s.config.rows[t] > 16 ||
      s.config.colsb[t] == 0 || s.config.colsb[t] > 64)
    std::abort();
}

inline void LoadConfig(const void* p) {
  State& s = Tiles();
  std::memcpy(&s.config, p, sizeof(Config));
  if (s.config.palette != 1) std::abort();  // the only palette with tiles
  s.configured = true;
  std::memset(s.tile, 0, sizeof(s.tile));  // ldtilecfg zeroes the tiles
}

inline void Release() {
  Tiles().configured = false;
  std::memset(Tiles().tile, 0, sizeof(Tiles().tile));
}

inline void Zero(int t) {
  Need(t);
  std::memset(Tiles().tile[t], 0, sizeof(Tiles().tile[t]));
}

// rows[t] rows of colsb[t] bytes from base, `stride` bytes apart; the rest of
// each row zeroed
inline void Load(int t, const void* base, int64_t stride) {
  Need(t);
  State& s = Tiles();
  std::memset(s.tile[t], 0, sizeof(s.tile[t]));
  for (int r = 0; r < s.config.rows[t]; ++r)
    std::memcpy(s.tile[t][r], static_cast<const uint8_t*>(base) + r * stride,
                s.config.colsb[t]);
}

inline void Store(int t, void* base, int64_t stride) {
  Need(t);
  const State& s = Tiles();
  for (int r = 0; r < s.config.rows[t]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.tile[t][r], s.config.colsb[t]);
}

inline int32_t Int32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Intel's TDPB[SU][SU]D: for m < rows(c), n < colsb(c) / 4, k < colsb(a) / 4:
//   c[m][n] += sum_j a[m][4k + j] * b[k][4n + j]   (j < 4; bytes signed or not)
// with rows(b) == colsb(a) / 4 and colsb(b) == colsb(c), the sum in 32 bits
// (wrapping)
template <bool ASigned, bool BSigned>
inline void DotProduct(int c, int a, int b) {
  Need(c), Need(a), Need(b);
  State& s = Tiles();
  const Config& g = s.config;
  if (g.rows[a] != g.rows[c] || g.colsb[b] != g.colsb[c] || g.rows[b] * 4 != g.colsb[a] ||
      g.colsb[c] % 4 || g.colsb[a] % 4)
    std::abort();
  for (int m = 0; m < g.rows[c]; ++m)
    for (int n = 0; n < g.colsb[c] / 4; ++n) {
      uint32_t sum = static_cast<uint32_t>(Int32(s.tile[c][m] + 4 * n));
      for (int k = 0; k < g.colsb[a] / 4; ++k)
        for (int j = 0; j < 4; ++j) {
          const uint8_t x = s.tile[a][m][4 * k + j], w = s.tile[b][k][4 * n + j];
          const int32_t xv = ASigned ? static_cast<int8_t>(x) : x;
          const int32_t wv = BSigned ? static_cast<int8_t>(w) : w;
          sum += static_cast<uint32_t>(xv * wv);
        }
      const int32_t out = static_cast<int32_t>(sum);
      std::memcpy(s.tile[c][m] + 4 * n, &out, 4);
    }
}

}  // namespace qarray_amx_emulation

// the intrinsics' names (immintrin.h's, tile numbers as their first arguments),
// in place of its definitions
#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbssd
#undef _tile_dpbsud
#undef _tile_dpbusd
#undef _tile_dpbuud
#define _tile_loadconfig(p) qarray_amx_emulation::LoadConfig(p)
#define _tile_release() qarray_amx_emulation::Release()
#define _tile_zero(t) qarray_amx_emulation::Zero(t)
#define _tile_loadd(t, base, stride) qarray_amx_emulation::Load(t, base, stride)
#define _tile_stored(t, base, stride) qarray_amx_emulation::Store(t, base, stride)
#define _tile_dpbssd(c, a, b) qarray_amx_emulation::DotProduct<true, true>(c, a, b)
#define _tile_dpbsud(c, a, b) qarray_amx_emulation::DotProduct<true, false>(c, a, b)
#define _tile_dpbusd(c, a, b) qarray_amx_emulation::DotProduct<false, true>(c, a, b)
#define _tile_dpbuud(c, a, b) qarray_amx_emulation::DotProduct<false, false>(c, a, b)
