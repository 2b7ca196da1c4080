// The handlers' arithmetic written once over an instruction set's int8 tile
// operations I (tiles_avx512.cc, tiles_avx2.cc, tiles_amx.cc, tiles_neon.cc
// include this inside their own namespace, after their target pragma, with
// their I and their vector type V for the row quantizer).
//
// Products run on int8 rows of x against the int8 (or int4) weights:
//   x side: int8 rows (x quantized per row, or split in `split` int8 parts
//           each quantizing what the previous left: float32 precision),
//           padded with zeros to a multiple of 32 bytes, one scale per row;
//           stored as level + I::kXBias (u8) for instruction sets whose
//           products take x unsigned (AVX-512's vpdpbusd): a tile's sums
//           start from -kXBias times the weights' sums per channel, which
//           the panels keep (SpanStarts);
//   few rows (below gemm_rows; kn: up to kn_dot_rows; int4: below
//           int4_gemm_rows rows of x): dot products straight off the
//           weights (NkDotRows, KnDotProduct, Int4DotRows where I::kDotPaths;
//           else the provider's own: AVX-512's, or AMX's next set);
//   more rows: a GEMM on panels, blocks of 8 output channels x 4 consecutive
//           k (32 bytes, channel c's four bytes at 4c), K/4 steps a block, a
//           pair's steps side by side (kStepBytes: 16 channels x 4 k, AMX's
//           tile row, one AVX-512 vector), whole tiles of pairs, packed per
//           call from the weights (PackNk, PackKn, PackInt4), each used while
//           in L2 (kPanelBytes) by every block of rows: tiles of kTileRows
//           rows x kTilePairs pairs of int32 sums (two accumulators a row),
//           four bytes of a row broadcast against each step (or the
//           provider's own Tile: AMX).
// Sums of int8 products are exact in int32 while K < 2^17 (127 x 128 a
// product), then scaled in float32.
//
// I provides: kLanes (int32 lanes of Acc: 8, or 16 where one vector holds a
// step), kXBias (0, or 128: x's bytes unsigned), kDotPaths; kPairs (and
// PairSteps: two rows at a time, i8mm's smmla); Acc, W (a loaded block of
// 4 kLanes bytes), Zero(), LoadW(p), LoadAcc(p), Store(p, acc), Dot(acc, w,
// x4) (acc[c] += sum_j w[4c + j] * x4's byte j), ScaleInto(p, acc, s, add)
// (conv's sums scaled into floats); for the dot paths DotVec(acc, w, x32)
// (lane-wise partial sums of 32 products), Sum(acc), FAcc, FZero(),
// FmaScaled(f, acc, s), FSum(f) (int4's group scaling), LoadInt4W(q) (16
// packed bytes -> a block of 32 int8: low nibbles, then high ones);
// PackNk8(rows, ld, k, dst, stride) (8 rows of k int8, k a multiple of 32 ->
// k / 4 blocks of 32 bytes, `stride` apart), KnQuads(rows[4], j, out[4][32])
// (32 columns of 4 kn rows -> four blocks in column order), Int4Row(q, out)
// (16 packed bytes -> 32 int8 in k order), Prefetch(p); kPacksPairs and
// PackInt4Pair (int4 weights straight into a pair's steps: AVX-512's 64-byte
// rows); kTransposes and Transpose8Out, Transpose16x16 (conv's copies through
// registers).
// And how its GEMM tiles take the panels: kTileRows (rows of x a tile takes;
// the vector tiles: as many as their sums' registers allow), kTilePairs,
// kWholeTiles (no tiles of fewer rows: x is padded with zero rows to a
// multiple of kTileRows), kStepAlign (panels' steps and x's rows padded to a
// multiple of it), Scope (alive while a thread runs tiles: AMX's tile state),
// kOwnTile and Tile<MR>(x, xs, w, steps, out) (its own tile over a pair's
// steps, else DotSteps').

struct Panel8 {
  std::vector<int8_t, CacheAligned<int8_t>> w;  // pairs x k4 steps x kStepBytes
  int64_t k4 = 0, blocks = 0;
  // kXBias providers: where each pair's 16 sums start for each span of `span`
  // steps (the whole panel, or an int4 group): -kXBias x the weights' sums,
  // what x's bias adds
  std::vector<int32_t> start;
  int64_t span = 0;
  // block b's first step; its steps are kStepBytes apart
  const int8_t* Block(int64_t b) const {
    return w.data() + (b / 2) * k4 * kStepBytes + (b % 2) * 32;
  }
  int8_t* Block(int64_t b) { return w.data() + (b / 2) * k4 * kStepBytes + (b % 2) * 32; }
  // room for K = k and `channels` channels (whole tiles, K / 4 steps padded
  // to the provider's alignment); returns whether the packing writes every
  // byte. Where it does not (padding past K or past the channels) the panel
  // starts as zeros; where it does, the bytes are left as they were: a
  // thread's panels are reused from call to call, and zeroing what the
  // packing overwrites was a visible part of a small GEMM
  // (benchmarks/gemm_crossover.py)
  bool Shape(int64_t k, int64_t channels);
  const int32_t* Start(int64_t pair, int64_t s0) const {
    return start.data() + (pair * (k4 / span) + s0 / span) * 16;
  }
};

// rows of x that stream their weights from memory: two threads read them
// faster than one from a quarter of the work on
constexpr int64_t kFewRows = 4;

constexpr int64_t RoundUp(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// K / 4 steps of a panel, padded to the provider's alignment
inline int64_t PanelSteps(int64_t k) { return RoundUp((k + 3) / 4, I::kStepAlign); }

// a tile's channels: kTilePairs pairs of blocks (16 channels each), a row's
// sums in kAccs of I's vectors; panels hold whole tiles (zero channels past
// the last)
constexpr int kTileCols = 16 * I::kTilePairs;
constexpr int kAccs = kTileCols / I::kLanes;
static_assert(kAccs == 2 && kAccs * I::kLanes == kTileCols,
              "a tile's channels fill two accumulators a row (DotSteps)");
template <int MR>
using Sums = typename I::Acc[MR][kAccs];
template <int MR>
using TileOut = int32_t[MR][kTileCols];

// acc[r][0..1] += `steps` groups of 4 bytes of MR rows (x + r * xs) times two
// blocks' steps (w0, w1: 32 bytes a step, kStepBytes apart): the loop every
// tile shares
template <class Ops, int MR>
inline void PairSteps(typename Ops::Acc (&acc)[MR][2], const int8_t* x, int64_t xs,
                      const int8_t* w0, const int8_t* w1, int64_t steps) {
  Ops::template PairSteps<MR>(acc, x, xs, w0, w1, steps);  // (looked up when used)
}

// where accumulator a of a tile reads its weights: its pair's steps (ws
// apart) and its part of each step
inline int64_t AccOffset(int a, int64_t ws) {
  constexpr int per_pair = 16 / I::kLanes;
  return (a / per_pair) * ws + (a % per_pair) * 4 * I::kLanes;
}

// acc += `steps` groups of 4 bytes of MR rows (x + r * xs) times a tile's
// steps from w (kStepBytes apart; its pairs ws apart): the loop every vector
// tile shares
template <int MR>
inline void DotSteps(Sums<MR>& acc, const int8_t* x, int64_t xs, const int8_t* w,
                     int64_t ws, int64_t steps) {
  if constexpr (I::kPairs && MR % 2 == 0 && I::kTilePairs == 1) {  // two rows at a time
    PairSteps<I, MR>(acc, x, xs, w, w + 32, steps);
    return;
  }
  // two named weight vectors: GCC kept an array of them on the stack
  const int64_t w1 = AccOffset(1, ws);
  for (int64_t g = 0; g < steps; ++g) {
    const typename I::W v0 = I::LoadW(w + g * kStepBytes), v1 = I::LoadW(w + g * kStepBytes + w1);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * xs + 4 * g, 4);
      I::Dot(acc[r][0], v0, four);
      I::Dot(acc[r][1], v1, four);
    }
  }
}

// a tile's sums from `pair`, for the span from step s0: zeros, or (kXBias
// providers) the span's starts
template <int MR>
inline void StartAcc(Sums<MR>& acc, const Panel8& p, int64_t pair, int64_t s0) {
  constexpr int per_pair = 16 / I::kLanes;
  for (int a = 0; a < kAccs; ++a) {
    typename I::Acc start = I::Zero();
    if constexpr (I::kXBias != 0)
      start = I::LoadAcc(p.Start(pair + a / per_pair, s0) + (a % per_pair) * I::kLanes);
    for (int r = 0; r < MR; ++r) acc[r][a] = start;
  }
}

template <int MR>
inline void StoreAcc(Sums<MR>& acc, TileOut<MR>& out) {
  for (int r = 0; r < MR; ++r)
    for (int a = 0; a < kAccs; ++a) I::Store(out[r] + I::kLanes * a, acc[r][a]);
}

// the panel's starts for spans of `span` steps (kXBias providers): x4 = four
// ones gives Dot's sum of a step's weights per channel
inline void SpanStarts(Panel8& p, int64_t span) {
  if constexpr (I::kXBias != 0) {
    p.span = span;
    const int64_t pairs = p.blocks / 2, spans = p.k4 / span;
    p.start.resize(pairs * spans * 16);
    for (int64_t pair = 0; pair < pairs; ++pair)
      for (int64_t sp = 0; sp < spans; ++sp) {
        constexpr int per_pair = 16 / I::kLanes;
        typename I::Acc acc[per_pair];
        for (auto& v : acc) v = I::Zero();
        const int8_t* w = p.Block(2 * pair) + sp * span * kStepBytes;
        for (int64_t g = 0; g < span; ++g)
          for (int a = 0; a < per_pair; ++a)
            I::Dot(acc[a], I::LoadW(w + g * kStepBytes + 4 * I::kLanes * a), 0x01010101);
        int32_t* out = p.start.data() + (pair * spans + sp) * 16;
        for (int a = 0; a < per_pair; ++a) I::Store(out + I::kLanes * a, acc[a]);
        for (int j = 0; j < 16; ++j) out[j] *= -I::kXBias;
      }
  } else {
    (void)p, (void)span;
  }
}

// the provider's own tile (looked up when used: only providers with
// kOwnTile): whole, or started, given steps (added to its sums), stored
template <class Ops, int MR>
inline void OwnTile(const int8_t* x, int64_t xs, const int8_t* w, int64_t steps,
                    TileOut<MR>& out) {
  Ops::template Tile<MR>(x, xs, w, steps, out);
}
template <class Ops>
inline void OwnTileStart() {
  Ops::TileStart();
}
template <class Ops>
inline void OwnTileSteps(const int8_t* x, int64_t xs, const int8_t* w, int64_t steps) {
  Ops::TileSteps(x, xs, w, steps);
}
template <class Ops, int MR>
inline void OwnTileStore(TileOut<MR>& out) {
  Ops::template TileStore<MR>(out);
}

// MR rows from x (xs apart) times the panel's tile of channels from pair
// `pair`, K steps [s0, s0 + steps) (a span of the panel's, for kXBias
// providers)
template <int MR>
inline void PanelTile(const int8_t* x, int64_t xs, const Panel8& p, int64_t pair,
                      int64_t s0, int64_t steps, TileOut<MR>& out) {
  if constexpr (I::kOwnTile) {
    OwnTile<I, MR>(x + 4 * s0, xs, p.Block(2 * pair) + s0 * kStepBytes, steps, out);
  } else {
    Sums<MR> acc;
    StartAcc<MR>(acc, p, pair, s0);
    DotSteps<MR>(acc, x + 4 * s0, xs, p.Block(2 * pair) + s0 * kStepBytes, p.k4 * kStepBytes,
                 steps);
    StoreAcc<MR>(acc, out);
  }
}

// f(MR, row) for every block of kTileRows rows of [r0, r1), then the rest:
// (kWholeTiles) one more whole block, whose rows past r1 are zeros the
// caller does not write out, or blocks of half as many rows, and half that
template <int MR, class F>
inline void RestRows(int64_t r, int64_t r1, F f) {
  if (r + MR <= r1) {
    f(std::integral_constant<int, MR>{}, r);
    r += MR;
  }
  if constexpr (MR > 1) RestRows<MR / 2>(r, r1, f);
}

template <class F>
inline void ForRowBlocks(int64_t r0, int64_t r1, F f) {
  constexpr int kMR = I::kTileRows;
  int64_t r = r0;
  for (; r + kMR <= r1; r += kMR) f(std::integral_constant<int, kMR>{}, r);
  if constexpr (I::kWholeTiles) {
    if (r < r1) f(std::integral_constant<int, kMR>{}, r);
  } else {
    RestRows<kMR / 2>(r, r1, f);
  }
}

// rows of x's buffers for `rows` rows: whole tiles' padding included
inline int64_t AllocatedRows(int64_t rows) {
  return I::kWholeTiles ? RoundUp(rows, I::kTileRows) : rows;
}

// --- packing

inline bool Panel8::Shape(int64_t k, int64_t channels) {
  k4 = PanelSteps(k);
  blocks = RoundUp(channels, kTileCols) / 8;
  const bool whole = k4 * 4 == k && channels % kTileCols == 0;
  const auto bytes = static_cast<size_t>(blocks * k4 * 32);
  if (whole) {
    w.resize(bytes);
  } else {
    w.assign(bytes, 0);
  }
  return whole;
}

// channels [n0, n1) of nk weights (row c: k int8, ld apart) into p
inline void PackNk(const int8_t* q, int64_t ld, int64_t k, int64_t n0, int64_t n1,
                   Panel8& p) {
  p.Shape(k, n1 - n0);
  for (int64_t b = 0; b * 8 < n1 - n0; ++b) {
    const int64_t c0 = n0 + 8 * b, lanes = std::min<int64_t>(8, n1 - c0);
    int8_t* dst = p.Block(b);
    const int64_t whole = lanes == 8 ? k / 32 * 32 : 0;  // 8 full rows, 32 k at a time
    if (whole) I::PackNk8(q + c0 * ld, ld, whole, dst, kStepBytes);
    for (int64_t c = 0; c < lanes; ++c)
      for (int64_t i = whole; i < k; ++i)
        dst[(i / 4) * kStepBytes + 4 * c + i % 4] = q[(c0 + c) * ld + i];
  }
  SpanStarts(p, p.k4);
}

// weight rows PackKn prefetches ahead of the four it interleaves: a chunk
// reads each row's few hundred bytes and jumps N on, a stride the hardware
// prefetchers follow late, so the packing's loads would hold up a kn GEMM;
// how far ahead: benchmarks.bench_kernels --strategies, the kn GEMM rows,
// weights cold and hot (docs/kernels.md)
constexpr int64_t kKnPrefetchRows = 16;

// columns [n0, n1) of kn weights' rows [0, rows) (row i: n int8 from q + i * n)
inline void PackKn(const int8_t* q, int64_t n, int64_t rows, int64_t n0, int64_t n1,
                   Panel8& p) {
  p.Shape(rows, n1 - n0);
  const int64_t width = n1 - n0, whole = width / 32 * 32;
  for (int64_t g = 0; g * 4 < rows; ++g) {
    const int8_t* r[4];
    int64_t real = std::min<int64_t>(4, rows - 4 * g);
    for (int t = 0; t < 4; ++t) r[t] = q + (4 * g + std::min<int64_t>(t, real - 1)) * n + n0;
    if (real == 4) {
      for (int64_t j = 0; j < whole; j += 32) {
        if (j % 64 == 0)  // a hint: an address past the end does not fault
          for (int t = 0; t < 4; ++t) I::Prefetch(r[t] + kKnPrefetchRows * n + j);
        alignas(32) int8_t quads[4][32];
        I::KnQuads(r, j, quads);
        for (int blk = 0; blk < 4; ++blk)
          std::memcpy(p.Block(j / 8 + blk) + g * kStepBytes, quads[blk], 32);
      }
    }
    for (int64_t j = real == 4 ? whole : 0; j < width; ++j)
      for (int t = 0; t < real; ++t)
        p.Block(j / 8)[g * kStepBytes + 4 * (j % 8) + t] = r[t][j];
  }
  SpanStarts(p, p.k4);
}

// `parts` int8 rows a row of x (times fold, if given) into out (ks apart:
// rows (r, part) at parts * r + part) and their scales, stored as level +
// kXBias
template <class V>
inline void QuantizeRows(const float* x, const float* fold, int64_t m, int64_t k, int64_t ks,
                         int64_t parts, int8_t* out, float* sx) {
  int8_t* s8 = I::kXBias ? nullptr : out;
  uint8_t* u8 = I::kXBias ? reinterpret_cast<uint8_t*>(out) : nullptr;
  if (parts > 1) return SplitRowsT<V>(x, fold, m, k, ks, static_cast<int>(parts), s8, u8, sx);
  for (int64_t r = 0; r < m; ++r)
    sx[r] = QuantizeRowT<V>(x + r * k, fold, k,
                            RowOut{nullptr, s8 ? s8 + r * ks : nullptr, u8 ? u8 + r * ks : nullptr});
}

// QuantizeRows on the pool's threads, a range of rows each, from
// kParallelRows elements (parts included): on the fastest tiles one thread
// quantizing x would be a visible share of a many-row product
// (benchmarks.compare_builds)
constexpr int64_t kParallelRows = 1 << 16;
template <class V>
inline void QuantizeRowsOn(Pool& pool, const float* x, const float* fold, int64_t m, int64_t k,
                           int64_t ks, int64_t parts, int8_t* out, float* sx) {
  const int64_t threads = m * k * parts < kParallelRows ? 1 : pool.num_threads();
  if (threads <= 1) return QuantizeRows<V>(x, fold, m, k, ks, parts, out, sx);
  Parallel(pool, m, (m + 2 * threads - 1) / (2 * threads), threads,
           [=](int64_t r0, int64_t r1) {
             QuantizeRows<V>(x + r0 * k, fold, r1 - r0, k, ks, parts, out + r0 * parts * ks,
                             sx + r0 * parts);
           },
           std::shared_ptr<void>());
}

// --- the int8 product (common.h's ProductArgs)

struct ProductState {
  ProductArgs a;
  int64_t parts, rows, ks;
  std::vector<int8_t> xs;  // rows x ks
  std::vector<float> sx;
};

// bytes [p, end) fetched into L2 in `shares` parts, one a Next(): the next
// panel's weights (nk: contiguous rows) while the tiles of this one compute,
// so that packing it reads L2 rather than memory (packing otherwise waits on
// those reads at the rows a served batch of one-row requests computes:
// benchmarks.bench_kernels --strategies)
struct FetchAhead {
  const int8_t* p;
  const int8_t* end;
  int64_t share;
  FetchAhead(const int8_t* begin, const int8_t* stop, int64_t shares)
      : p(begin), end(stop), share(RoundUp((stop - begin) / std::max<int64_t>(shares, 1) + 1, 64)) {}
  void Next() {
    for (int64_t b = 0; b < share && p < end; b += 64, p += 64) __builtin_prefetch(p, 0, 2);
  }
};

// nk, channels [n0, n1): panels that stay in L2, each packed then every block
// of rows passed over it (the next panel's weights fetched meanwhile); the
// parts' sums added into y in part order
inline void ProductNk(const ProductState& s, int64_t n0, int64_t n1) {
  const typename I::Scope tiles;
  const ProductArgs& a = s.a;
  for (int64_t r = 0; r < a.m; ++r) std::fill(a.y + r * a.n + n0, a.y + r * a.n + n1, 0.0f);
  const int64_t step = std::max<int64_t>(kTileCols, kPanelBytes / std::max<int64_t>(a.k, 1) / kTileCols * kTileCols);
  thread_local Panel8 panel;
  for (int64_t c0 = n0; c0 < n1; c0 += step) {
    const int64_t c1 = std::min(n1, c0 + step);
    PackNk(a.q, a.k, a.k, c0, c1, panel);
    const int64_t tiles = (s.rows + I::kTileRows - 1) / I::kTileRows *
                          ((c1 - c0 + 16 * I::kTilePairs - 1) / (16 * I::kTilePairs));
    FetchAhead ahead(a.q + c1 * a.k, a.q + std::min(n1, c1 + step) * a.k, tiles);
    ForRowBlocks(0, s.rows, [&](auto mr, int64_t row) {
      constexpr int MR = decltype(mr)::value;
      for (int64_t pair = 0; pair * 16 < c1 - c0; pair += I::kTilePairs) {
        ahead.Next();
        TileOut<MR> out;
        PanelTile<MR>(s.xs.data() + row * s.ks, s.ks, panel, pair, 0, panel.k4, out);
        const int64_t c = c0 + 16 * pair, cols = std::min<int64_t>(kTileCols, c1 - c);
        for (int r = 0; r < MR && row + r < s.rows; ++r) {
          float* y = a.y + ((row + r) / s.parts) * a.n + c;
          const float sx = s.sx[row + r];
          for (int64_t j = 0; j < cols; ++j)
            y[j] += static_cast<float>(out[r][j]) * sx * a.scale[c + j];
        }
      }
    });
  }
}

// kn, columns [n0, n1): the panel's rows of q are N apart, so it is packed a
// block of K at a time across the whole chunk (each weight row read along
// its chunk), the integer sums carried across the blocks in int32 (exact),
// then scaled (the weights' scales folded into x already)
inline void ProductKn(const ProductState& s, int64_t n0, int64_t n1) {
  const typename I::Scope tiles;
  const ProductArgs& a = s.a;
  const int64_t width = n1 - n0, unit = 4 * I::kStepAlign;
  const int64_t block = std::max<int64_t>(unit, kPanelBytes / width / unit * unit);
  std::vector<int32_t> sums(s.rows * width, 0);
  thread_local Panel8 panel;
  for (int64_t k0 = 0; k0 < a.k; k0 += block) {
    const int64_t kb = std::min(block, a.k - k0);
    PackKn(a.q + k0 * a.n, a.n, kb, n0, n1, panel);
    ForRowBlocks(0, s.rows, [&](auto mr, int64_t row) {
      constexpr int MR = decltype(mr)::value;
      for (int64_t pair = 0; pair * 16 < width; pair += I::kTilePairs) {
        TileOut<MR> out;
        PanelTile<MR>(s.xs.data() + row * s.ks + k0, s.ks, panel, pair, 0, panel.k4, out);
        const int64_t cols = std::min<int64_t>(kTileCols, width - 16 * pair);
        for (int r = 0; r < MR && row + r < s.rows; ++r)
          for (int64_t j = 0; j < cols; ++j)
            sums[(row + r) * width + 16 * pair + j] += out[r][j];
      }
    });
  }
  // scaled along the rows (vectorized), the parts added in part order
  for (int64_t r = 0; r < a.m; ++r) {
    float* y = a.y + r * a.n + n0;
    for (int64_t part = 0; part < s.parts; ++part) {
      const int32_t* sum = sums.data() + (r * s.parts + part) * width;
      const float sx = s.sx[r * s.parts + part];
      if (part == 0) {
        for (int64_t j = 0; j < width; ++j) y[j] = static_cast<float>(sum[j]) * sx;
      } else {
        for (int64_t j = 0; j < width; ++j) y[j] += static_cast<float>(sum[j]) * sx;
      }
    }
  }
}

// --- few rows: dot products straight off the weights, no panel (at one row
// packing the weights costs as much as the product: make bench, suite kernels)

// layout nk: R rows from `row` times NB output channels from c, each channel's
// row of K bytes read once for the R rows
template <class Ops, int R, int NB>
inline void NkDotTile(const ProductState& s, int64_t row, int64_t c) {
  const ProductArgs& a = s.a;
  const int64_t full = a.k / 32 * 32;
  typename Ops::Acc acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = Ops::Zero();
  const int8_t* x = s.xs.data() + row * s.ks;  // rows padded with zeros to ks
  for (int64_t i = 0; i < full; i += 32) {
    // the next tile's rows (a page apart each: the hardware prefetchers stop
    // at page ends); a hint, an address past the end does not fault
    if (i % 64 == 0)
      for (int b = 0; b < NB; ++b) Ops::Prefetch(a.q + (c + 2 * NB + b) * a.k + i);
    for (int b = 0; b < NB; ++b) {
      const typename Ops::W w = Ops::LoadW(a.q + (c + b) * a.k + i);
      for (int r = 0; r < R; ++r) Ops::DotVec(acc[r][b], w, x + r * s.ks + i);
    }
  }
  if (full < a.k) {  // the rows' last bytes, zero-padded to 32
    for (int b = 0; b < NB; ++b) {
      alignas(32) int8_t tail[32] = {};
      std::memcpy(tail, a.q + (c + b) * a.k + full, a.k - full);
      const typename Ops::W w = Ops::LoadW(tail);
      for (int r = 0; r < R; ++r) Ops::DotVec(acc[r][b], w, x + r * s.ks + full);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* y = a.y + ((row + r) / s.parts) * a.n + c;
    const float sx = s.sx[row + r];
    for (int b = 0; b < NB; ++b)
      y[b] += static_cast<float>(Ops::Sum(acc[r][b])) * sx * a.scale[c + b];
  }
}

// channels [n0, n1), four at a time, every row (two at a time) over each four
// while their weights are in L1; the parts added into y in part order
template <class Ops>
inline void NkDotRows(const ProductState& s, int64_t n0, int64_t n1) {
  const ProductArgs& a = s.a;
  for (int64_t r = 0; r < a.m; ++r) std::fill(a.y + r * a.n + n0, a.y + r * a.n + n1, 0.0f);
  auto rows = [&](auto nb, int64_t c) {
    constexpr int NB = decltype(nb)::value;
    // weight-only's one row of x (three parts) in one pass over the weights
    if (s.rows == 3) return NkDotTile<Ops, 3, NB>(s, 0, c);
    int64_t r = 0;
    for (; r + 2 <= s.rows; r += 2) NkDotTile<Ops, 2, NB>(s, r, c);
    if (r < s.rows) NkDotTile<Ops, 1, NB>(s, r, c);
  };
  int64_t c = n0;
  for (; c + 4 <= n1; c += 4) rows(std::integral_constant<int, 4>{}, c);
  for (; c < n1; ++c) rows(std::integral_constant<int, 1>{}, c);
}

// layout kn, weight rows [k0, k1) (a multiple of 8 from k0) into sums
// (rows x n int32): eight weight rows a pass, four at a time interleaved in
// registers into blocks of 4 k (Ops::KnQuads), against four bytes of each int8
// row broadcast; the sums (in L1/L2) loaded and stored once per pass. A
// thread takes a contiguous range of weight rows, streaming its share of
// memory in order (columns split over threads instead touched every page of
// the weights once per thread and 4 KiB of it: TLB misses;
// benchmarks.bench_kernels, one row of x)
template <class Ops>
inline void KnDotRange(const ProductState& s, int64_t k0, int64_t k1, int32_t* sums) {
  const ProductArgs& a = s.a;
  const int64_t n = a.n, whole = n / 32 * 32;
  std::fill(sums, sums + s.rows * n, 0);
  for (int64_t i = k0; i < k1; i += 8) {
    // rows past K meet zeros of x (padded to 32 bytes): any row serves
    const int8_t* r[8];
    for (int t = 0; t < 8; ++t) r[t] = a.q + std::min<int64_t>(i + t, a.k - 1) * n;
    int32_t x4[kMaxKnDotRows][2];
    for (int64_t row = 0; row < s.rows; ++row)
      std::memcpy(x4[row], s.xs.data() + row * s.ks + i, 8);
    for (int64_t j = 0; j < whole; j += 32) {
      for (int t = 0; t < 8; ++t) Ops::Prefetch(r[t] + 16 * n + j);  // two passes ahead
      alignas(32) int8_t quads[2][4][32];
      Ops::KnQuads(r, j, quads[0]);
      Ops::KnQuads(r + 4, j, quads[1]);
      typename Ops::W w[2][4];
      for (int h = 0; h < 2; ++h)
        for (int b = 0; b < 4; ++b) w[h][b] = Ops::LoadW(quads[h][b]);
      for (int64_t row = 0; row < s.rows; ++row) {
        int32_t* at = sums + row * n + j;
        for (int b = 0; b < 4; ++b) {
          typename Ops::Acc acc = Ops::LoadAcc(at + 8 * b);
          Ops::Dot(acc, w[0][b], x4[row][0]);
          Ops::Dot(acc, w[1][b], x4[row][1]);
          Ops::Store(at + 8 * b, acc);
        }
      }
    }
    for (int64_t j = whole; j < n; ++j)  // the last columns
      for (int64_t row = 0; row < s.rows; ++row) {
        const int8_t* x = s.xs.data() + row * s.ks + i;
        int32_t sum = 0;
        for (int t = 0; t < 8; ++t) sum += x[t] * r[t][j];
        sums[row * n + j] += sum;
      }
  }
}

// layout kn with at most kn_dot_rows int8 rows (checked against kMaxKnDotRows):
// ranges of weight rows over the threads, then the ranges' sums added and scaled
template <class Ops>
inline void KnDotProduct(Pool& pool, int64_t threads, std::shared_ptr<ProductState> s) {
  const ProductArgs& a = s->a;
  const int64_t step = ((a.k + threads - 1) / threads + 7) / 8 * 8;
  const int64_t ranges = (a.k + step - 1) / step;
  auto sums = std::make_shared<std::vector<int32_t>>(ranges * s->rows * a.n);
  const ProductState* p = s.get();
  int32_t* out = sums->data();
  Parallel(pool, ranges, 1, threads,
           [p, step, out](int64_t c0, int64_t c1) {
             for (int64_t c = c0; c < c1; ++c)
               KnDotRange<Ops>(*p, c * step, std::min(p->a.k, (c + 1) * step),
                          out + c * p->rows * p->a.n);
           },
           std::make_shared<std::pair<std::shared_ptr<ProductState>,
                                      std::shared_ptr<std::vector<int32_t>>>>(s, sums));
  for (int64_t m = 0; m < a.m; ++m)
    for (int64_t j = 0; j < a.n; ++j) {
      float sum = 0.0f;
      for (int64_t part = 0; part < s->parts; ++part) {
        const int64_t row = m * s->parts + part;
        int32_t total = 0;
        for (int64_t c = 0; c < ranges; ++c) total += out[(c * s->rows + row) * a.n + j];
        sum += static_cast<float>(total) * s->sx[row];
      }
      a.y[m * a.n + j] = sum;
    }
}

// whether ProductT runs a GEMM on panels (else the dot paths): from gemm_rows
// int8 rows for nk, past kn_dot_rows for kn
inline bool UsesGemm(const ProductArgs& a) {
  const int64_t rows = (a.int8 ? 1 : a.t.split) * a.m;
  return a.kn ? rows > a.t.kn_dot_rows : rows >= a.t.gemm_rows;
}

// the threads a product of `rows` int8 rows takes: a few rows stream their
// weights from memory, which two threads read faster than one from a quarter
// of the work on
inline int64_t ProductThreads(const Pool& pool, int64_t rows, int64_t k, int64_t n) {
  return Threads(pool, rows * k * n * (rows <= kFewRows ? 4 : 1));
}

// x's int8 rows for a product (null where there is nothing to compute: y
// written already)
template <class V>
std::shared_ptr<ProductState> ProductRows(Pool& pool, const ProductArgs& args) {
  if (args.m == 0 || args.n == 0) return nullptr;
  if (args.k == 0) {
    std::memset(args.y, 0, sizeof(float) * args.m * args.n);
    return nullptr;
  }
  auto s = std::make_shared<ProductState>();
  s->a = args;
  const ProductArgs& a = s->a;
  s->parts = a.int8 ? 1 : a.t.split;
  s->rows = s->parts * a.m;
  // rows padded with zeros to 32 bytes (the dot paths read 32 at a time) or
  // to the panels' steps; whole tiles' rows past the last are zeros
  s->ks = RoundUp(a.k, std::max<int64_t>(32, 4 * I::kStepAlign));
  s->xs.assign(AllocatedRows(s->rows) * s->ks, 0);
  s->sx.resize(s->rows);
  // kn: v = x * scale
  QuantizeRowsOn<V>(pool, a.x, a.kn ? a.scale : nullptr, a.m, a.k, s->ks, s->parts, s->xs.data(),
                  s->sx.data());
  return s;
}

template <class V>
void ProductT(Pool& pool, const ProductArgs& args) {
  const std::shared_ptr<ProductState> s = ProductRows<V>(pool, args);
  if (!s) return;
  const ProductArgs& a = s->a;
  const int64_t threads = ProductThreads(pool, s->rows, a.k, a.n);
  const bool gemm = UsesGemm(a);
  if constexpr (I::kDotPaths) {
    if (a.kn && !gemm) return KnDotProduct<I>(pool, threads, s);
  }
  const ProductState* p = s.get();
  Parallel(pool, a.n, ChunkSize(a.n, threads, 4), threads,
           [p, gemm](int64_t n0, int64_t n1) {
             if (p->a.kn) return ProductKn(*p, n0, n1);
             if constexpr (I::kDotPaths) {
               if (!gemm) return NkDotRows<I>(*p, n0, n1);
             }
             ProductNk(*p, n0, n1);
           },
           s);
}

// --- int4 weights (common.h's Int4Args): the nibbles unpacked into the
// panel, each group's integer sums scaled by the group's scale in float32

struct Int4Panel {
  Panel8 p;
  std::vector<float> sg;  // scale[c, g] per (block, group, lane)
  int64_t groups = 0, g4 = 0;  // g4: steps of 4 k per group
};

// the provider's packing of a pair's 16 channels of int4 weights (looked up
// when used: providers with kPacksPairs)
template <class Ops>
inline void PackedInt4Pair(const uint8_t* q, int64_t half, int64_t lanes, int64_t k,
                           int8_t* dst) {
  Ops::PackInt4Pair(q, half, lanes, k, dst);
}

inline void PackInt4(const Int4Args& a, int64_t n0, int64_t n1, Int4Panel& panel) {
  Panel8& p = panel.p;
  const int64_t half = a.k / 2, groups = a.k / a.group;
  // K / 4 steps: a multiple of the group's steps (providers align groups)
  const bool whole = p.Shape(a.k, n1 - n0);
  panel.groups = groups;
  panel.g4 = a.group / 4;
  if (whole) {
    panel.sg.resize(p.blocks * groups * 8);
  } else {
    panel.sg.assign(p.blocks * groups * 8, 0.0f);
  }
  alignas(32) int8_t rows[8][32];
  for (int64_t b = 0; b * 8 < n1 - n0; ++b) {
    const int64_t c0 = n0 + 8 * b, lanes = std::min<int64_t>(8, n1 - c0);
    int8_t* dst = p.Block(b);
    if constexpr (I::kPacksPairs) {  // a pair's 16 channels at a time
      if (b % 2 == 0)
        PackedInt4Pair<I>(a.q + c0 * half, half, std::min<int64_t>(16, n1 - c0), a.k, dst);
    } else {
      for (int64_t i = 0; i < a.k; i += 32) {  // k is a multiple of the group, of 32
        for (int64_t c = 0; c < 8; ++c) {
          if (c < lanes)
            I::Int4Row(a.q + (c0 + c) * half + i / 2, rows[c]);
          else
            std::memset(rows[c], 0, 32);
        }
        I::PackNk8(&rows[0][0], 32, 32, dst + (i / 4) * kStepBytes, kStepBytes);
      }
    }
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t c = 0; c < lanes; ++c)
        panel.sg[(b * groups + g) * 8 + c] = a.scale[(c0 + c) * groups + g];
  }
  SpanStarts(p, panel.g4);
}

struct Int4State {
  Int4Args a;
  int64_t parts, rows;
  std::vector<int8_t> xs;  // rows x k
  std::vector<float> sx;
};

inline void Int4Chunk(const Int4State& s, int64_t n0, int64_t n1) {
  const typename I::Scope tiles;
  const Int4Args& a = s.a;
  for (int64_t r = 0; r < a.m; ++r) std::fill(a.y + r * a.n + n0, a.y + r * a.n + n1, 0.0f);
  // packed int4 weights take half the bytes of int8: panels of 2 kPanelBytes
  // of them unpacked
  const int64_t step = std::max<int64_t>(kTileCols, kPanelBytes / std::max<int64_t>(a.k, 1) / kTileCols * kTileCols);
  thread_local Int4Panel panel;
  for (int64_t c0 = n0; c0 < n1; c0 += step) {
    const int64_t c1 = std::min(n1, c0 + step);
    PackInt4(a, c0, c1, panel);
    ForRowBlocks(0, s.rows, [&](auto mr, int64_t row) {
      constexpr int MR = decltype(mr)::value;
      for (int64_t pair = 0; pair * 16 < c1 - c0; pair += I::kTilePairs) {
        float f[MR][kTileCols] = {};
        for (int64_t g = 0; g < panel.groups; ++g) {
          TileOut<MR> out;
          PanelTile<MR>(s.xs.data() + row * a.k, a.k, panel.p, pair, g * panel.g4, panel.g4,
                        out);
          for (int b = 0; b < kTileCols / 8; ++b) {  // the tile's blocks' group scales
            const float* sg = panel.sg.data() + ((2 * pair + b) * panel.groups + g) * 8;
            for (int r = 0; r < MR; ++r)
              for (int j = 0; j < 8; ++j) f[r][8 * b + j] += static_cast<float>(out[r][8 * b + j]) * sg[j];
          }
        }
        const int64_t c = c0 + 16 * pair, cols = std::min<int64_t>(kTileCols, c1 - c);
        for (int r = 0; r < MR && row + r < s.rows; ++r) {
          float* y = a.y + ((row + r) / s.parts) * a.n + c;
          for (int64_t j = 0; j < cols; ++j) y[j] += f[r][j] * s.sx[row + r];
        }
      }
    });
  }
}

// few rows: dot products straight off the packed rows (no panel), the
// nibbles widened in registers 32 at a time (I::LoadInt4W: 16 bytes' low
// nibbles, then their high ones, so x's rows are permuted to match, each 32
// entries as its 16 even then its 16 odd ones: PermuteEvenOdd), each group's
// integer sums scaled into float32 lanes, summed across lanes at the end
template <class Ops, int R, int NB>
inline void Int4DotTile(const Int4State& s, int64_t row, int64_t c) {
  const Int4Args& a = s.a;
  const int64_t half = a.k / 2, groups = a.k / a.group;
  typename Ops::FAcc f[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) f[r][b] = Ops::FZero();
  const int8_t* x = s.xs.data() + row * a.k;
  for (int64_t g = 0; g < groups; ++g) {
    typename Ops::Acc acc[R][NB];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b] = Ops::Zero();
    for (int64_t i = g * a.group; i < (g + 1) * a.group; i += 32) {
      if (i % 128 == 0)  // the next tile's rows, as NkDotTile
        for (int b = 0; b < NB; ++b) Ops::Prefetch(reinterpret_cast<const int8_t*>(
                                         a.q + (c + 2 * NB + b) * half + i / 2));
      for (int b = 0; b < NB; ++b) {
        const typename Ops::W w = Ops::LoadInt4W(a.q + (c + b) * half + i / 2);
        for (int r = 0; r < R; ++r) Ops::DotVec(acc[r][b], w, x + r * a.k + i);
      }
    }
    for (int b = 0; b < NB; ++b) {
      const float scale = a.scale[(c + b) * groups + g];
      for (int r = 0; r < R; ++r) f[r][b] = Ops::FmaScaled(f[r][b], acc[r][b], scale);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* y = a.y + ((row + r) / s.parts) * a.n + c;
    for (int b = 0; b < NB; ++b) y[b] += Ops::FSum(f[r][b]) * s.sx[row + r];
  }
}

template <class Ops>
inline void Int4DotRows(const Int4State& s, int64_t n0, int64_t n1) {
  const Int4Args& a = s.a;
  for (int64_t r = 0; r < a.m; ++r) std::fill(a.y + r * a.n + n0, a.y + r * a.n + n1, 0.0f);
  auto rows = [&](auto nb, int64_t c) {
    constexpr int NB = decltype(nb)::value;
    if (s.rows == 3) return Int4DotTile<Ops, 3, NB>(s, 0, c);  // as NkDotRows
    int64_t r = 0;
    for (; r + 2 <= s.rows; r += 2) Int4DotTile<Ops, 2, NB>(s, r, c);
    if (r < s.rows) Int4DotTile<Ops, 1, NB>(s, r, c);
  };
  int64_t c = n0;
  for (; c + 4 <= n1; c += 4) rows(std::integral_constant<int, 4>{}, c);
  for (; c < n1; ++c) rows(std::integral_constant<int, 1>{}, c);
}

// each 32 entries of each row as its 16 even entries, then its 16 odd ones
inline void PermuteEvenOdd(std::vector<int8_t>& xs) {
  int8_t block[32];
  for (size_t i = 0; i + 32 <= xs.size(); i += 32) {
    for (int j = 0; j < 16; ++j) {
      block[j] = xs[i + 2 * j];
      block[16 + j] = xs[i + 2 * j + 1];
    }
    std::memcpy(xs.data() + i, block, 32);
  }
}

// x's int8 rows for an int4 product (W4A8: one a row of x, weight-only: split
// parts), K as it is (a multiple of the group, so of 32): ProductInt4T's and
// the providers' own GEMMs (AMX's)
template <class V>
std::shared_ptr<Int4State> Int4XRows(Pool& pool, const Int4Args& args) {
  auto s = std::make_shared<Int4State>();
  s->a = args;
  const Int4Args& a = s->a;
  s->parts = a.int8 ? 1 : a.t.split;
  s->rows = s->parts * a.m;
  s->xs.assign(AllocatedRows(s->rows) * a.k, 0);
  s->sx.resize(s->rows);
  QuantizeRowsOn<V>(pool, a.x, nullptr, a.m, a.k, a.k, s->parts, s->xs.data(), s->sx.data());
  return s;
}

template <class V>
void ProductInt4T(Pool& pool, const Int4Args& args) {
  if (args.m == 0 || args.n == 0) return;
  const std::shared_ptr<Int4State> s = Int4XRows<V>(pool, args);
  const Int4Args& a = s->a;
  const bool gemm = a.m >= a.t.int4_gemm_rows;
  if constexpr (I::kDotPaths) {
    if (!gemm) PermuteEvenOdd(s->xs);  // k: a multiple of 32
  }
  const int64_t threads = ProductThreads(pool, s->rows, a.k, a.n);
  const Int4State* p = s.get();
  Parallel(pool, a.n, ChunkSize(a.n, threads, 4), threads,
           [p, gemm](int64_t n0, int64_t n1) {
             if constexpr (I::kDotPaths) {
               if (!gemm) return Int4DotRows<I>(*p, n0, n1);
             }
             Int4Chunk(*p, n0, n1);
           },
           s);
}

// --- conv_q: an implicit GEMM over a padded channels-last copy of x
//
// Each example is quantized as one row (W8A8: one scale per example, conv_q's
// numerics) or split in parts (weight-only), and written channels last
// (channels padded to a multiple of 4) inside a border of zeros (the
// padding). For each kernel offset, MR consecutive output positions of a line
// read MR rows of channels a fixed stride apart, so the tile runs on that
// buffer directly, offset after offset, with the weights packed offset-major
// (no im2col copy).

struct ConvState {
  ConvArgs a;
  int64_t cg, cg4, og, parts, positions, offsets, plane;
  std::vector<int8_t> xc;  // (parts * batch, *padded, cpad)
  int64_t cpad;
  std::vector<float> sx;   // per example part
  Panel8 panel;            // one group's weights, k = offsets * cg4
  int64_t group = 0;
};

// MR output positions (o2 ... of line (o0, o1)) of example part e times the
// panel's tile of channels from pair `pair`, times scale, into v (added to it
// with add): scaled in registers (through a stack array, the stores to y
// that follow were held up by the loads of its lines), and not inlined
// (inlined, GCC spilled the sums: make bench, suite conv)
template <int MR>
[[gnu::noinline]] void ConvTile(const ConvState& c, int64_t e, int64_t o0, int64_t o1, int64_t o2,
                     int64_t pair, const float* scale, bool add,
                     float (&v)[MR][kTileCols]) {
  const ConvGeometry& g = c.a.g;
  const Panel8& p = c.panel;
  const int8_t* w = p.Block(2 * pair);
  const int64_t row_step = g.stride[2] * c.cpad, c4 = c.cg4 / 4;
  const int8_t* xe = c.xc.data() + e * c.plane * c.cpad + c.group * c.cg;
  // f(x, step): each kernel offset's MR rows of channels (row_step apart)
  // and its first step in the panel
  auto offsets = [&](auto f) {
    int64_t step = 0;
    for (int64_t i0 = 0; i0 < g.k[0]; ++i0)
      for (int64_t i1 = 0; i1 < g.k[1]; ++i1)
        for (int64_t i2 = 0; i2 < g.k[2]; ++i2) {
          const int64_t p0 = o0 * g.stride[0] + i0 * g.dilation[0];
          const int64_t p1 = o1 * g.stride[1] + i1 * g.dilation[1];
          const int64_t p2 = o2 * g.stride[2] + i2 * g.dilation[2];
          f(xe + ((p0 * g.padded[1] + p1) * g.padded[2] + p2) * c.cpad, step);
          step += c4;
        }
  };
  if constexpr (I::kOwnTile) {  // the provider's tile, summed over the offsets
    TileOut<MR> out;
    OwnTileStart<I>();
    offsets([&](const int8_t* x, int64_t step) {
      OwnTileSteps<I>(x, row_step, w + step * kStepBytes, c4);
    });
    OwnTileStore<I, MR>(out);
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < kTileCols; j += I::kLanes)
        I::ScaleInto(v[r] + j, I::LoadAcc(out[r] + j), scale + j, add);
  } else {
    Sums<MR> acc;
    StartAcc<MR>(acc, p, pair, 0);
    offsets([&](const int8_t* x, int64_t step) {
      DotSteps<MR>(acc, x, row_step, w + step * kStepBytes, p.k4 * kStepBytes, c4);
    });
    for (int r = 0; r < MR; ++r)
      for (int a = 0; a < kAccs; ++a)
        I::ScaleInto(v[r] + a * I::kLanes, acc[r][a], scale + a * I::kLanes, add);
  }
}

// the provider's 8 x 8 transpose (looked up when used: providers with kTransposes)
template <class Ops, int MR>
inline void Transposed8(const float* in, int64_t ld_in, int64_t cols, float* out,
                        int64_t ld_out) {
  Ops::Transpose8Out(in, ld_in, cols, out, ld_out);
}

// v's columns [0, cols) to dst + j * ld, its first `rows` values each (a
// whole tile's rows past the line are not y's): y's (channels, positions)
// layout; 8 x 8 blocks through the provider's register transpose where it
// has one (kTransposes)
template <int MR>
inline void StoreColumns(const float (&v)[MR][kTileCols], int64_t cols, int64_t rows,
                         float* dst, int64_t ld) {
  if constexpr (I::kTransposes && MR % 8 == 0) {
    if (rows == MR) {
      for (int r0 = 0; r0 < MR; r0 += 8)
        for (int64_t b = 0; b < cols; b += 8)
          Transposed8<I, MR>(&v[r0][b], kTileCols, std::min<int64_t>(8, cols - b),
                             dst + b * ld + r0, ld);
      return;
    }
  }
  for (int64_t j = 0; j < cols; ++j)
    for (int r = 0; r < rows; ++r) dst[j * ld + r] = v[r][j];
}

// lines [l0, l1) of all examples (a line: fixed o0, o1; all of o2)
inline void ConvLines(const ConvState& c, int64_t l0, int64_t l1) {
  const typename I::Scope tiles;
  const ConvGeometry& g = c.a.g;
  const ConvArgs& a = c.a;
  const int64_t lines = g.out[0] * g.out[1], ch0 = c.group * c.og;
  for (int64_t l = l0; l < l1; ++l) {
    const int64_t b = l / lines, line = l % lines, o0 = line / g.out[1], o1 = line % g.out[1];
    float* y = a.y + (b * a.out_channels + ch0) * c.positions + line * g.out[2];
    // a tile of channels down the line: kTileCols rows of y written in order
    for (int64_t pair = 0; pair * 16 < c.og; pair += I::kTilePairs) {
      const int64_t cols = std::min<int64_t>(kTileCols, c.og - 16 * pair);
      ForRowBlocks(0, g.out[2], [&](auto mr, int64_t o2) {
        constexpr int MR = decltype(mr)::value;
        // the example's parts summed in part order in whole rows of the
        // tile (vectorized), then written once, channel by channel (y's
        // lines past the caches are not read back per part)
        alignas(64) float v[MR][kTileCols];
        for (int64_t part = 0; part < c.parts; ++part) {
          const int64_t e = b * c.parts + part;
          alignas(64) float scale[kTileCols] = {};
          for (int64_t j = 0; j < cols; ++j) scale[j] = c.sx[e] * a.scale[ch0 + 16 * pair + j];
          ConvTile<MR>(c, e, o0, o1, o2, pair, scale, part > 0, v);
        }
        StoreColumns<MR>(v, cols, std::min<int64_t>(MR, g.out[2] - o2),
                         y + 16 * pair * c.positions + o2, c.positions);
      });
    }
  }
}

// the provider's 16 x 16 byte transpose (looked up when used: kTransposes)
template <class Ops>
inline void Transposed16(const int8_t* src, int64_t ld_src, int8_t* dst, int64_t ld_dst) {
  Ops::Transpose16x16(src, ld_src, dst, ld_dst);
}

// one example's levels (C, *S) channels last into its padded plane (rows of
// cpad bytes), in blocks of 16 channels x 16 positions of a line transposed
// (a byte at a time, this copy took about a fifth of the PointNet row: make
// bench, suite conv)
inline void ChannelsLast(const ConvState& c, const int8_t* src, int8_t* base) {
  const ConvGeometry& g = c.a.g;
  const int64_t plane_in = g.in[0] * g.in[1] * g.in[2], n2 = g.in[2];
  for (int64_t p0 = 0; p0 < g.in[0]; ++p0)
    for (int64_t p1 = 0; p1 < g.in[1]; ++p1) {
      const int8_t* line = src + (p0 * g.in[1] + p1) * n2;
      int8_t* dst = base + (((p0 + g.pad[0]) * g.padded[1] + p1 + g.pad[1]) * g.padded[2] +
                            g.pad[2]) * c.cpad;
      for (int64_t ch = 0; ch < c.a.channels; ch += 16) {
        const int64_t chs = std::min<int64_t>(16, c.a.channels - ch);
        for (int64_t p2 = 0; p2 < n2; p2 += 16) {
          const int64_t ps = std::min<int64_t>(16, n2 - p2);
          if constexpr (I::kTransposes) {  // in registers
            if (chs == 16 && ps == 16) {
              Transposed16<I>(line + ch * plane_in + p2, plane_in, dst + p2 * c.cpad + ch, c.cpad);
              continue;
            }
          }
          int8_t block[16][16];  // [position][channel]
          for (int64_t t = 0; t < chs; ++t)
            for (int64_t j = 0; j < ps; ++j) block[j][t] = line[(ch + t) * plane_in + p2 + j];
          for (int64_t j = 0; j < ps; ++j) std::memcpy(dst + (p2 + j) * c.cpad + ch, block[j], chs);
        }
      }
    }
}

template <class V>
void ConvT(Pool& pool, const ConvArgs& args) {
  auto s = std::make_shared<ConvState>();
  ConvState& c = *s;
  c.a = args;
  const ConvGeometry& g = c.a.g;
  c.cg = c.a.channels / g.groups;
  c.og = c.a.out_channels / g.groups;
  c.offsets = g.k[0] * g.k[1] * g.k[2];
  // an offset's channels: whole steps of the panel (kStepAlign: AMX's
  // tiles take 64 of them, the channels past cg multiplied by zero weights)
  c.cg4 = RoundUp(c.cg, 4 * I::kStepAlign);
  // a group's last step stays inside the buffer (the bytes it reads past the
  // group's channels: the next channels or position's, times zero weights)
  c.cpad = c.a.channels + 4;
  c.positions = g.out[0] * g.out[1] * g.out[2];
  c.plane = g.padded[0] * g.padded[1] * g.padded[2];
  c.parts = c.a.int8 ? 1 : c.a.t.split;
  if (c.a.batch == 0 || c.positions == 0 || c.a.out_channels == 0) return;
  const int64_t plane_in = g.in[0] * g.in[1] * g.in[2], example = c.a.channels * plane_in;
  const int64_t examples = c.parts * c.a.batch;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  c.sx.resize(examples);
  // (and whole tiles' rows past the last line: AllocatedRows)
  const int64_t past = AllocatedRows(g.out[2]) * g.stride[2] * c.cpad + c.cg4;
  c.xc.assign(examples * c.plane * c.cpad + past, static_cast<int8_t>(I::kXBias));  // zeros
  {
    ConvState* p = s.get();
    Parallel(pool, c.a.batch, 1, example < 4096 ? 1 : threads,
             [p, example, plane_in](int64_t b0, int64_t b1) {
               ConvState& c = *p;
               const ConvGeometry& g = c.a.g;
               std::vector<int8_t> xq(c.parts * example);
               for (int64_t b = b0; b < b1; ++b) {
                 QuantizeRows<V>(c.a.x + b * example, nullptr, 1, example, example, c.parts,
                                 xq.data(), c.sx.data() + b * c.parts);
                 for (int64_t part = 0; part < c.parts; ++part)
                   ChannelsLast(c, xq.data() + part * example,
                                c.xc.data() + (b * c.parts + part) * c.plane * c.cpad);
               }
             },
             s);
  }
  const int64_t lines = c.a.batch * g.out[0] * g.out[1];
  const int64_t work = examples * c.positions * c.og * c.offsets * c.cg4;
  const int64_t gemm_threads = work < kParallelWork ? 1 : threads;
  const int64_t per_chunk = std::max<int64_t>(1, lines / (4 * gemm_threads));
  const int64_t k = c.offsets * c.cg4;
  std::vector<int8_t> rows;
  for (int64_t gi = 0; gi < g.groups; ++gi) {
    // the group's weights (og rows of cg * offsets, channel-major) offset-major
    // with the channels padded to cg4: row o, entry (off, ch)
    rows.assign(c.og * k, 0);
    const int8_t* q = c.a.q + gi * c.og * c.cg * c.offsets;
    for (int64_t o = 0; o < c.og; ++o)
      for (int64_t ch = 0; ch < c.cg; ++ch)
        for (int64_t off = 0; off < c.offsets; ++off)
          rows[o * k + off * c.cg4 + ch] = q[(o * c.cg + ch) * c.offsets + off];
    PackNk(rows.data(), k, k, 0, c.og, c.panel);
    c.group = gi;
    const ConvState* p = s.get();
    Parallel(pool, lines, per_chunk, gemm_threads,
             [p](int64_t l0, int64_t l1) { ConvLines(*p, l0, l1); }, s);
  }
}
