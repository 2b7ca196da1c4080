// qarray's AMX tiles (Intel Xeon since Sapphire Rapids), for the products
// that are bound by compute.
//
// TDPBSSD multiplies tile A (16 rows x 64 signed bytes) by tile B (16 steps
// of 16 columns x 4 signed bytes) into C (16 x 16 int32 sums): 16K
// multiply-adds an instruction, against VNNI's 64 a vector. Both operands are
// signed, so x needs no +128 shift and the sums no correction. Every tile is
// 16 rows, so x's buffers hold whole tiles (zero rows past the last) and x's
// rows are padded to 64 bytes of K (kStepAlign).
//
//   layout nk (int8 and int4): the weights are A, straight from their rows
//     (WeightsFirst, below); x's rows are B, packed once a call;
//   layout kn: gemm.h's panel driver with I8Amx's tile (x as A, a panel's
//     pair of blocks as B: its 64-byte steps are B's rows);
//   conv_q: gemm.h's implicit GEMM with I8Amx's tile summed over the kernel
//     offsets, each offset's channels padded to 64 (Conv's rules, below).
//
// What the tiles do not take goes to the next best instruction set (Next(),
// AVX-512 on every CPU with AMX): products below the GEMM's thresholds (a few
// rows read their weights from memory: the vector tiles are as fast there),
// int4 with groups of fewer than 64 values (a group's sums are scaled apart,
// and AMX's K is 64), the convolutions Conv leaves, and the row quantizer.
//
// The tile state is the thread's: TileScope loads the configuration where a
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

#include "tiles_avx2.h"

// _tile_loadconfig's 64 bytes
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "AMX's tile configuration is 64 bytes");

// every tile 16 rows x 64 bytes, a constant: GCC 12's _tile_loadconfig tells
// the compiler it reads 8 bytes, so a configuration built on the stack had
// its rows and widths dropped as dead stores (ldtilecfg then faulted)
constexpr TileConfig AllTilesConfig() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  return config;
}
alignas(64) constexpr TileConfig kAllTiles = AllTilesConfig();

// the tile state, alive while a thread runs tiles: loaded where a thread
// starts on a chunk of work and released after (XLA's pool threads may run
// other AMX code between our calls)
struct TileScope {
  TileScope() { _tile_loadconfig(&kAllTiles); }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// gemm.h's tiles on AMX; its packing is AVX2's (the dot paths are not built
// here: Next() takes that work)
struct I8Amx : I8Avx2 {
  static constexpr int kTileRows = 16;
  static constexpr bool kWholeTiles = true, kOwnTile = true;
  static constexpr bool kDotPaths = false;  // Next() takes the few rows
  static constexpr int64_t kStepAlign = 16;  // a tile's K: 16 steps of 4 bytes

  // tiles 0 (sums: 16 x 16 int32), 1 (16 rows of x, 64 bytes), 2 (16 steps
  // of a pair of blocks, 64 bytes)
  using Scope = TileScope;

  // 16 rows of x (xs bytes apart, 4 bytes a step) times a pair of blocks'
  // `steps` steps from w (a multiple of 16): whole (Tile), or the sums
  // started, steps added (conv: a kernel offset's at a time), stored
  static void TileStart() { _tile_zero(0); }
  static void TileSteps(const int8_t* x, int64_t xs, const int8_t* w, int64_t steps) {
    for (int64_t s = 0; s < steps; s += kStepAlign) {
      _tile_loadd(1, x + 4 * s, xs);
      _tile_loadd(2, w + s * kStepBytes, kStepBytes);
      _tile_dpbssd(0, 1, 2);
    }
  }
  template <int MR>
  static void TileStore(int32_t (&out)[MR][16]) {
    static_assert(MR == kTileRows, "AMX's tiles are whole");
    _tile_stored(0, out, 16 * sizeof(int32_t));
  }
  template <int MR>
  static void Tile(const int8_t* x, int64_t xs, const int8_t* w, int64_t steps,
                   int32_t (&out)[MR][16]) {
    TileStart();
    TileSteps(x, xs, w, steps);
    TileStore<MR>(out);
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

// --- layout nk: the weights as AMX's left operand, straight from memory
//
// y^T = W x^T: tile A is 16 output channels x 64 k of W, rows k bytes apart
// (W's own layout: nothing packed), tile B 16 steps of x's int8 rows packed
// as gemm.h packs weights (PackNk: 16 rows x 4 k a step, the small operand),
// C their 16 channels x 16 rows of int32 sums. Packing the weights would
// cost more than the products at the rows a served batch has
// (benchmarks.bench_kernels --strategies, on AMX).
// Several C tiles at once (WeightTiles): the loads of A and B are shared and
// the sums' tiles are independent, so tdpbssd does not wait on its own
// previous result.

// CB blocks of 16 channels (a[i]: k bytes a row, lda apart) x RB blocks of
// 16 rows of x (b[j]: panel steps) over steps [s0, s0 + steps) of 4 k (both
// multiples of 16) into sums[i * RB + j] (channel, row); CB x RB: 4 x 1,
// 2 x 2 or 2 x 1
template <int CB, int RB>
void WeightTiles(const int8_t* const (&a)[CB], int64_t lda, const int8_t* const (&b)[RB],
                 int64_t s0, int64_t steps, int32_t (*sums)[16][16]) {
  static_assert((CB == 4 && RB == 1) || (CB == 2 && RB <= 2), "C tiles 0-3");
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (CB * RB > 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t s = s0; s < s0 + steps; s += I8Amx::kStepAlign) {
    _tile_loadd(6, b[0] + s * kStepBytes, kStepBytes);
    if constexpr (RB == 2) _tile_loadd(7, b[1] + s * kStepBytes, kStepBytes);
    _tile_loadd(4, a[0] + 4 * s, lda);
    _tile_dpbssd(0, 4, 6);
    if constexpr (RB == 2) _tile_dpbssd(1, 4, 7);
    _tile_loadd(5, a[1] + 4 * s, lda);
    if constexpr (RB == 2) {
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    } else {
      _tile_dpbssd(1, 5, 6);
    }
    if constexpr (CB == 4) {
      _tile_loadd(4, a[2] + 4 * s, lda);
      _tile_dpbssd(2, 4, 6);
      _tile_loadd(5, a[3] + 4 * s, lda);
      _tile_dpbssd(3, 5, 6);
    }
  }
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  if constexpr (CB * RB > 2) {
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
  }
}

// where a product's int8 rows of x go: row r is part r % parts of y's row
// r / parts (y: n floats a row), scaled by sx[r]
struct RowsOut {
  float* y;
  int64_t n, rows, parts;
  const float* sx;
};

// v (16 channels from c x 16 int8 rows from row: int32 sums, or float32
// ones) times scale[c + j] (where given) into y's channels below `end` (the
// chunk's: a tile past it holds another thread's channels, as zeros): the
// first part written, the others added in part order (gemm.h's order)
template <class T>
void ChannelRowsOut(const RowsOut& o, const T (&v)[16][16], const float* scale, int64_t c,
                    int64_t end, int64_t row) {
  static_assert(sizeof(T) == 4, "transposed as 32-bit lanes");
  alignas(32) T t[16][16];  // (row, channel)
  for (int bj = 0; bj < 16; bj += 8)
    for (int bi = 0; bi < 16; bi += 8)
      I8Amx::Transpose8Out(reinterpret_cast<const float*>(&v[bj][bi]), 16, 8,
                           reinterpret_cast<float*>(&t[bi][bj]), 16);
  const int64_t cols = std::max<int64_t>(0, std::min<int64_t>(16, end - c));
  alignas(32) float sc[16];  // the channels' scales (ones where none), zeros past n
  for (int j = 0; j < 16; ++j) sc[j] = j < cols ? (scale ? scale[c + j] : 1.0f) : 0.0f;
  const __m256 s0 = _mm256_load_ps(sc), s1 = _mm256_load_ps(sc + 8);
  for (int i = 0; i < 16 && row + i < o.rows; ++i) {
    const int64_t r = row + i;
    const __m256 sx = _mm256_set1_ps(o.sx[r]);
    __m256 f0, f1;
    if constexpr (std::is_same_v<T, float>) {
      f0 = _mm256_load_ps(t[i]);
      f1 = _mm256_load_ps(t[i] + 8);
    } else {
      f0 = _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(t[i])));
      f1 = _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(t[i] + 8)));
    }
    // (sums x scale) x sx, the order of gemm.h's products
    f0 = _mm256_mul_ps(_mm256_mul_ps(f0, s0), sx);
    f1 = _mm256_mul_ps(_mm256_mul_ps(f1, s1), sx);
    float* y = o.y + (r / o.parts) * o.n + c;
    alignas(32) float out[16];
    if (cols == 16) {
      if (r % o.parts != 0) {
        f0 = _mm256_add_ps(_mm256_loadu_ps(y), f0);
        f1 = _mm256_add_ps(_mm256_loadu_ps(y + 8), f1);
      }
      _mm256_storeu_ps(y, f0);
      _mm256_storeu_ps(y + 8, f1);
      continue;
    }
    _mm256_store_ps(out, f0);
    _mm256_store_ps(out + 8, f1);
    for (int64_t j = 0; j < cols; ++j) y[j] = r % o.parts == 0 ? out[j] : y[j] + out[j];
  }
}

// x's int8 rows packed as tile B's steps (gemm.h's PackNk, rows taking the
// place of channels) once a call, a panel of per_panel rows at a time, for
// every chunk of channels to read (packed per chunk, 512 rows were packed
// eight times: benchmarks.compare_builds)
struct PackedRows {
  std::shared_ptr<void> owner;  // what xs lives in
  std::vector<Panel8> panels;
  int64_t per_panel = 0, rows = 0;
};

inline std::shared_ptr<PackedRows> PackRows(Pool& pool, std::shared_ptr<void> owner,
                                            const int8_t* xs, int64_t ks, int64_t rows) {
  auto packed = std::make_shared<PackedRows>();
  packed->owner = std::move(owner);
  packed->rows = rows;
  packed->per_panel = std::max<int64_t>(16, kPanelBytes / ks / 16 * 16);
  const int64_t count = (rows + packed->per_panel - 1) / packed->per_panel;
  packed->panels.resize(count);
  PackedRows* p = packed.get();
  Parallel(pool, count, 1, count > 1 ? pool.num_threads() : 1,
           [p, xs, ks](int64_t i0, int64_t i1) {
             for (int64_t i = i0; i < i1; ++i)
               PackNk(xs, ks, ks, i * p->per_panel, std::min(p->rows, (i + 1) * p->per_panel),
                      p->panels[i]);
           },
           packed);
  return packed;
}

// channels [n0, n1) of y = x W^T (W: n channels of k), every block of
// channels passed over each panel of x's rows in turn:
//   weights(c, width) -> {w, lda}: channels [c, c + width) of W as int8 rows
//     (whole tiles: zeros past n1 and past K);
//   tiles(CB, RB, wa, lda, xb, c, v): v[i * RB + j] (channel, row) from
//     WeightTiles<CB, RB>, T (int32 or float32), then times scale[channel]
//     where scale is given.
template <class T, class Weights, class Tiles>
void WeightsFirst(const PackedRows& x, const RowsOut& o, const float* scale, int64_t n0,
                  int64_t n1, Weights weights, Tiles tiles) {
  const TileScope state;  // C 0-3, A 4-5, B 6-7
  alignas(32) T v[4][16][16];
  for (size_t i = 0; i < x.panels.size(); ++i) {
    const Panel8& panel = x.panels[i];
    const int64_t r0 = i * x.per_panel, pairs = panel.blocks / 2;
    // one block of rows: four of channels share it; more: two by two
    const int64_t width = pairs == 1 ? 64 : 32;
    for (int64_t c = n0; c < n1; c += width) {
      const auto [w, lda] = weights(c, width);
      if (pairs == 1) {
        const int8_t* const wa[4] = {w, w + 16 * lda, w + 32 * lda, w + 48 * lda};
        const int8_t* const xb[1] = {panel.Block(0)};
        tiles(std::integral_constant<int, 4>{}, std::integral_constant<int, 1>{}, wa, lda, xb,
              c, v);
        for (int cb = 0; cb < 4; ++cb) ChannelRowsOut(o, v[cb], scale, c + 16 * cb, n1, r0);
        continue;
      }
      const int8_t* const wa[2] = {w, w + 16 * lda};
      int64_t pair = 0;
      for (; pair + 2 <= pairs; pair += 2) {
        const int8_t* const xb[2] = {panel.Block(2 * pair), panel.Block(2 * pair + 2)};
        tiles(std::integral_constant<int, 2>{}, std::integral_constant<int, 2>{}, wa, lda, xb,
              c, v);
        for (int t = 0; t < 4; ++t)
          ChannelRowsOut(o, v[t], scale, c + 16 * (t / 2), n1, r0 + 16 * (pair + t % 2));
      }
      if (pair < pairs) {
        const int8_t* const xb[1] = {panel.Block(2 * pair)};
        tiles(std::integral_constant<int, 2>{}, std::integral_constant<int, 1>{}, wa, lda, xb,
              c, v);
        for (int t = 0; t < 2; ++t)
          ChannelRowsOut(o, v[t], scale, c + 16 * t, n1, r0 + 16 * pair);
      }
    }
  }
}

// a thread's buffer of whole tiles of weights (width x ks int8), zeros past
// the channels the caller fills
inline int8_t* WeightBuffer(int64_t width, int64_t ks) {
  thread_local std::vector<int8_t, CacheAligned<int8_t>> buffer;
  buffer.assign(width * ks, 0);
  return buffer.data();
}

void Product(Pool& pool, const ProductArgs& a) {
  if (a.m == 0 || a.n == 0 || a.k == 0 || !UsesGemm(a)) return Next().product(pool, a);
  if (a.kn) return ProductT<VecAvx2>(pool, a);
  const std::shared_ptr<ProductState> s = ProductRows<VecAvx2>(pool, a);
  const ProductState* p = s.get();
  const std::shared_ptr<PackedRows> x = PackRows(pool, s, s->xs.data(), s->ks, s->rows);
  const PackedRows* px = x.get();
  const int64_t threads = ProductThreads(pool, s->rows, a.k, a.n);
  Parallel(pool, a.n, ChunkSize(a.n, threads, 4), threads, [p, px](int64_t n0, int64_t n1) {
    const ProductArgs& a = p->a;
    // W's own rows where K fills whole tiles; else (and past n1) a copy
    auto weights = [&](int64_t c, int64_t width) -> std::pair<const int8_t*, int64_t> {
      if (a.k % 64 == 0 && c + width <= n1) return {a.q + c * a.k, a.k};
      int8_t* w = WeightBuffer(width, p->ks);
      for (int64_t j = 0; j < std::min(width, n1 - c); ++j)
        std::memcpy(w + j * p->ks, a.q + (c + j) * a.k, a.k);
      return {w, p->ks};
    };
    auto tiles = [&](auto cb, auto rb, const auto& wa, int64_t lda, const auto& xb, int64_t,
                     int32_t (*v)[16][16]) {
      WeightTiles<decltype(cb)::value, decltype(rb)::value>(wa, lda, xb, 0, p->ks / 4, v);
    };
    WeightsFirst<int32_t>(*px, RowsOut{a.y, a.n, p->rows, p->parts, p->sx.data()}, a.scale,
                          n0, n1, weights, tiles);
  }, x);
}

void ProductInt4(Pool& pool, const Int4Args& args) {
  if (args.m < args.t.int4_gemm_rows || args.group % (4 * I::kStepAlign))
    return Next().product_int4(pool, args);
  if (args.n == 0) return;
  const std::shared_ptr<Int4State> s = Int4XRows<VecAvx2>(pool, args);
  const Int4Args& a = s->a;
  const Int4State* p = s.get();
  const std::shared_ptr<PackedRows> x = PackRows(pool, s, s->xs.data(), a.k, s->rows);
  const PackedRows* px = x.get();
  const int64_t threads = ProductThreads(pool, s->rows, a.k, a.n);
  Parallel(pool, a.n, ChunkSize(a.n, threads, 4), threads, [p, px](int64_t n0, int64_t n1) {
    const Int4Args& a = p->a;
    const int64_t half = a.k / 2, groups = a.k / a.group, g4 = a.group / 4;
    // the nibbles unpacked (K: a multiple of the group, of 64)
    auto weights = [&](int64_t c, int64_t width) -> std::pair<const int8_t*, int64_t> {
      int8_t* w = WeightBuffer(width, a.k);
      for (int64_t j = 0; j < std::min(width, n1 - c); ++j)
        for (int64_t i = 0; i < a.k; i += 32) I::Int4Row(a.q + (c + j) * half + i / 2, w + j * a.k + i);
      return {w, a.k};
    };
    // each group's integer sums scaled by the group's scales, summed in float32
    auto tiles = [&](auto cb, auto rb, const auto& wa, int64_t lda, const auto& xb, int64_t c,
                     float (*v)[16][16]) {
      constexpr int CB = decltype(cb)::value, RB = decltype(rb)::value;
      std::memset(v, 0, sizeof(float) * CB * RB * 256);
      int32_t sums[4][16][16];
      for (int64_t g = 0; g < groups; ++g) {
        WeightTiles<CB, RB>(wa, lda, xb, g * g4, g4, sums);
        for (int t = 0; t < CB * RB; ++t)
          for (int j = 0; j < 16; ++j) {
            const int64_t ch = c + 16 * (t / RB) + j;
            const float scale = ch < a.n ? a.scale[ch * groups + g] : 0.0f;
            for (int i = 0; i < 16; ++i) v[t][j][i] += static_cast<float>(sums[t][j][i]) * scale;
          }
      }
    };
    WeightsFirst<float>(*px, RowsOut{a.y, a.n, p->rows, p->parts, p->sx.data()}, nullptr, n0,
                        n1, weights, tiles);
  }, x);
}

// conv_q's implicit GEMM on the tiles where a group has 32 channels or more
// (each kernel offset's channels are padded to 64, AMX's K: fewer would be
// mostly zeros) and a tile's K (offsets x padded channels) is 256 or more: a
// tile's sums are stored and scaled once per 16 positions x 16 channels,
// which below that cost more than the tiles saved (PointNet's 1 x 1 layer,
// 64 channels: benchmarks.compare_builds, conv rows)
constexpr int64_t kConvChannels = 32, kConvDepth = 256;
void Conv(Pool& pool, const ConvArgs& a) {
  const int64_t cg = a.channels / a.g.groups, offsets = a.g.k[0] * a.g.k[1] * a.g.k[2];
  if (cg < kConvChannels || offsets * RoundUp(cg, 64) < kConvDepth) return Next().conv(pool, a);
  ConvT<VecAvx2>(pool, a);
}

void Quantize(Pool& pool, const QuantizeArgs& a) { Next().quantize(pool, a); }

}  // namespace qarray::cpu::amx

#pragma GCC pop_options

namespace qarray::cpu {
extern const Isa kAmx = {"amx",          amx::Product,  amx::ProductInt4,
                         amx::Conv,      amx::Quantize,
                         amx::QuantizeRowEntry<amx::VecAvx2>};
}  // namespace qarray::cpu
