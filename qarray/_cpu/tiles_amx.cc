// qarray's AMX tiles (Intel Xeon since Sapphire Rapids): gemm.h's GEMM with
// its tile on AMX's tile registers, for the products that are bound by compute.
//
// TDPBSSD multiplies 16 rows x 64 signed bytes of x (tile 1) by 16 steps of a
// panel's pair of blocks (tile 2: 16 x 4 k of 16 output channels, the row
// layout gemm.h's panels keep, kStepBytes apart) into 16 x 16 int32 sums
// (tile 0): 16K multiply-adds an instruction, against VNNI's 64 a vector. Both
// operands are signed, so x needs no +128 shift and the sums no correction.
// Every tile is 16 rows, so x's buffers hold whole tiles (zero rows past the
// last) and panels and x's rows are padded to 64 bytes of K (kStepAlign).
//
// What the tiles do not take goes to the next best instruction set (Next(),
// AVX-512 on every CPU with AMX): products below the GEMM's thresholds (a few
// rows read their weights from memory: the vector tiles are as fast there),
// int4 with groups of fewer than 64 values (a group's sums are scaled apart,
// and AMX's K is 64), conv_q (its implicit GEMM takes each kernel offset's
// channels as K, rarely 64 of them) and the row quantizer.
//
// The tile state is the thread's: Scope loads the configuration where a
// thread starts on a chunk of tiles and releases it after (XLA's pool threads
// may run other AMX code between our calls). Linux hands a process the tile
// state only on request (arch_prctl, dispatch.cc's AmxPermitted).
//
// Compiled for any x86-64 like the other tile files (the target pragma after
// the shared headers); dispatch.cc calls these only where cpuid reports
// AMX-TILE and AMX-INT8 and Linux permits them. Test builds
// (QARRAY_EMULATE_AMX, the repository's root on the include path) take the
// intrinsics from tests/amx_emulation.h.

#include <immintrin.h>

#ifdef QARRAY_EMULATE_AMX
#include "tests/amx_emulation.h"
#endif

#include "common.h"

#pragma GCC push_options
#ifdef QARRAY_EMULATE_AMX
#pragma GCC target("avx2,fma")
#else
#pragma GCC target("avx2,fma,amx-tile,amx-int8")
#endif

namespace qarray::cpu::amx {

#include "avx2_ops.h"

// _tile_loadconfig's 64 bytes
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "AMX's tile configuration is 64 bytes");

// gemm.h's tiles on AMX; its packing is AVX2's (the dot paths are not built
// here: Next() takes that work)
struct I8Amx : I8Avx2 {
  static constexpr int kTileRows = 16;
  static constexpr bool kWholeTiles = true, kOwnTile = true;
  static constexpr bool kDotPaths = false;  // Next() takes the few rows
  static constexpr int64_t kStepAlign = 16;  // a tile's K: 16 steps of 4 bytes

  // tiles 0 (sums: 16 x 16 int32), 1 (16 rows of x, 64 bytes), 2 (16 steps
  // of a pair of blocks, 64 bytes)
  struct Scope {
    Scope() {
      TileConfig config;
      for (int t = 0; t < 3; ++t) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
      }
      _tile_loadconfig(&config);
    }
    ~Scope() { _tile_release(); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
  };

  // 16 rows of x (xs bytes apart, 4 bytes a step) times a pair of blocks'
  // `steps` steps from w (a multiple of 16)
  template <int MR>
  static void Tile(const int8_t* x, int64_t xs, const int8_t* w, int64_t steps,
                   int32_t (&out)[MR][16]) {
    static_assert(MR == kTileRows, "AMX's tiles are whole");
    _tile_zero(0);
    for (int64_t s = 0; s < steps; s += kStepAlign) {
      _tile_loadd(1, x + 4 * s, xs);
      _tile_loadd(2, w + s * kStepBytes, kStepBytes);
      _tile_dpbssd(0, 1, 2);
    }
    _tile_stored(0, out, 16 * sizeof(int32_t));
  }
};

using I = I8Amx;
#include "quantize_row.h"
#include "gemm.h"

// the instruction set below AMX in dispatch.cc's order: what the tiles leave
const Isa& Next() {
  static const Isa* next = Below("amx");
  return *next;
}

void Product(Pool& pool, const ProductArgs& a) {
  if (a.m == 0 || a.n == 0 || a.k == 0 || !UsesGemm(a)) return Next().product(pool, a);
  ProductT<VecAvx2>(pool, a);
}

void ProductInt4(Pool& pool, const Int4Args& a) {
  if (a.m < a.t.int4_gemm_rows || a.group % (4 * I::kStepAlign))
    return Next().product_int4(pool, a);
  ProductInt4T<VecAvx2>(pool, a);
}

void Conv(Pool& pool, const ConvArgs& a) { Next().conv(pool, a); }
void Quantize(Pool& pool, const QuantizeArgs& a) { Next().quantize(pool, a); }

}  // namespace qarray::cpu::amx

#pragma GCC pop_options

namespace qarray::cpu {
extern const Isa kAmx = {"amx",          amx::Product,  amx::ProductInt4,
                         amx::Conv,      amx::Quantize,
                         amx::QuantizeRowEntry<amx::VecAvx2>};
}  // namespace qarray::cpu
