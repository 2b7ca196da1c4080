// The C++ side's one int8 row quantizer, with qarray/_numerics.py's numerics:
//
//   scale = max|v| * float32(1 / 127)  (XLA's simplifier turns the division by
//           a constant into that product), NaN when the row holds a NaN
//   q     = round_half_even(v / d), d = scale if scale > 0 else 1, the
//           division correctly rounded, NaN quotients 0, clipped to [-127, 127]
//
// v = x * fold (fold: null, or one factor per column: layout kn's weight
// scales). Written once over a vector type V (each instruction set's tile file
// includes this inside its own namespace, after its target pragma, with its
// V: see VecAvx512 / VecAvx2 / VecNeon); the outputs: float levels, s8, or u8
// levels + 128 (what the dot-product instructions that take one unsigned
// operand read), any of them null.
//
// A division per element is what kept quantization from the bandwidth limit
// (make bench, suite kernels: the quantize row), so rows multiply by the
// reciprocal of their divisor instead: t = v * (1 / d) is within 2^-22 * |t| <=
// 2^-15 of v / d, so it rounds to the same integer unless it lies within
// kNearHalf of a half-integer; those (rare) vectors take the division.
// Divisors below FLT_MIN (whose reciprocal overflows), infinite ones and rows
// with a NaN divide every element.

constexpr float kNearHalf = 1.0f / 4096;

template <class V>
inline typename V::F RoundQuotient(typename V::F v, typename V::F divisor,
                                   typename V::F reciprocal) {
  const typename V::F t = V::Mul(v, reciprocal);
  typename V::F r = V::Round(t);
  // |t - r| is exact (r an integer within 0.5 of t); NaN lanes compare false
  const typename V::M near =
      V::Gt(V::Abs(V::Sub(t, r)), V::Set1(0.5f - kNearHalf));
  if (V::Any(near)) r = V::Select(near, V::Round(V::Div(v, divisor)), r);
  return r;
}

struct RowOut {
  float* levels = nullptr;
  int8_t* s8 = nullptr;
  uint8_t* u8 = nullptr;
  bool stream = false;  // s8 with streaming stores (64-byte aligned, k % 64 == 0)
};

template <class V>
inline typename V::F LoadFolded(const float* x, const float* fold, int64_t i) {
  typename V::F v = V::Load(x + i);
  return fold ? V::Mul(v, V::Load(fold + i)) : v;
}

template <class V>
inline void StoreLevels(typename V::F q, const RowOut& out, int64_t i) {
  if (out.levels) V::StoreF(out.levels + i, q);
  if (out.s8) V::StoreS8(out.s8 + i, q);
  if (out.u8) V::StoreU8(out.u8 + i, q);
}

template <class V>
float QuantizeRowT(const float* x, const float* fold, int64_t k, const RowOut& out) {
  using F = typename V::F;
  constexpr int W = V::W;
  const int64_t full = k / W * W, tail = k - full;
  // the last partial vector, zero-filled, through the same arithmetic
  alignas(64) float xt[W] = {}, ft[W] = {};
  if (tail) {
    std::memcpy(xt, x + full, tail * sizeof(float));
    if (fold) std::memcpy(ft, fold + full, tail * sizeof(float));
  }
  F vmax = V::Zero();
  typename V::M nan = V::None();
  for (int64_t i = 0; i < full; i += W) {
    const F v = LoadFolded<V>(x, fold, i);
    nan = V::Or(nan, V::Unord(v, v));
    vmax = V::Max(V::Abs(v), vmax);
  }
  if (tail) {
    const F v = LoadFolded<V>(xt, fold ? ft : nullptr, 0);
    nan = V::Or(nan, V::Unord(v, v));
    vmax = V::Max(V::Abs(v), vmax);
  }
  const bool has_nan = V::Any(nan);
  const float scale = has_nan ? std::numeric_limits<float>::quiet_NaN()
                              : V::ReduceMax(vmax) * (1.0f / 127.0f);
  const float d = scale > 0.0f ? scale : 1.0f;
  const F divisor = V::Set1(d);
  // a NaN or inf row (NaN quotients, to be 0) or a divisor whose reciprocal
  // overflows: every element divided, cleaned and clipped
  const bool exact = has_nan || !(d >= std::numeric_limits<float>::min()) ||
                     d == std::numeric_limits<float>::infinity();
  const F reciprocal = V::Set1(1.0f / d);
  const F lo = V::Set1(-127.0f), hi = V::Set1(127.0f);
  auto level = [&](F v) {
    if (!exact) return RoundQuotient<V>(v, divisor, reciprocal);  // within 127.5
    F q = V::Round(V::Div(v, divisor));
    q = V::Select(V::Unord(q, q), V::Zero(), q);
    return V::Min(V::Max(q, lo), hi);
  };
  int64_t i = 0;
  if (out.s8 && !out.levels && !out.u8) {  // four vectors packed at a time
    for (; i + 4 * W <= full; i += 4 * W)
      V::StoreS8x4(out.s8 + i, level(LoadFolded<V>(x, fold, i)),
                   level(LoadFolded<V>(x, fold, i + W)),
                   level(LoadFolded<V>(x, fold, i + 2 * W)),
                   level(LoadFolded<V>(x, fold, i + 3 * W)), out.stream);
  }
  for (; i < full; i += W) StoreLevels<V>(level(LoadFolded<V>(x, fold, i)), out, i);
  if (tail) {
    alignas(64) float lv[W];
    alignas(64) int8_t s8[W];
    alignas(64) uint8_t u8[W];
    const F q = level(LoadFolded<V>(xt, fold ? ft : nullptr, 0));
    RowOut t{lv, s8, u8, false};
    StoreLevels<V>(q, t, 0);
    if (out.levels) std::memcpy(out.levels + full, lv, tail * sizeof(float));
    if (out.s8) std::memcpy(out.s8 + full, s8, tail);
    if (out.u8) std::memcpy(out.u8 + full, u8, tail);
  }
  return scale;
}

// the Isa table's entry
template <class V>
float QuantizeRowEntry(const float* x, const float* fold, int64_t k, float* levels,
                       int8_t* s8, uint8_t* u8) {
  return QuantizeRowT<V>(x, fold, k, RowOut{levels, s8, u8, false});
}

// Each row of x (times fold, if given) as `parts` int8 rows, each quantizing
// what the previous left (x to ~(1/254)^parts of its row's largest entry;
// three parts: float32 precision): s8 or u8 rows of xq, `parts` per row, ks
// apart (k's padding left as it is), and their scales
template <class V>
void SplitRowsT(const float* x, const float* fold, int64_t m, int64_t k, int64_t ks,
                int parts, int8_t* s8, uint8_t* u8, float* sx) {
  std::vector<float> rest(k), levels(k);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < k; ++i) rest[i] = fold ? x[r * k + i] * fold[i] : x[r * k + i];
    for (int part = 0; part < parts; ++part) {
      const int64_t at = parts * r + part;
      RowOut out{levels.data(), s8 ? s8 + at * ks : nullptr, u8 ? u8 + at * ks : nullptr};
      sx[at] = QuantizeRowT<V>(rest.data(), nullptr, k, out);
      for (int64_t i = 0; i < k; ++i) rest[i] -= levels[i] * sx[at];
    }
  }
}

// the quantize handler's rows, ~256 KiB of input per chunk, over the threads
// for big inputs; q of an input past the caches goes straight to memory
// (streaming stores: no read of the lines it overwrites) where 64-byte
// stores align
constexpr int64_t kStreamElements = 8 << 20;  // 32 MiB of float32 input

template <class V>
void QuantizeT(Pool& pool, const QuantizeArgs& a) {
  if (a.m == 0) return;
  const int64_t chunk = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(a.k, 1));
  const bool stream = a.m * a.k >= kStreamElements &&
                      reinterpret_cast<uintptr_t>(a.q) % 64 == 0 && a.k % 64 == 0;
  auto keep = std::make_shared<QuantizeArgs>(a);
  const QuantizeArgs* p = keep.get();
  Parallel(pool, a.m, chunk, Threads(pool, a.m * a.k),
           [p, stream](int64_t r0, int64_t r1) {
             for (int64_t r = r0; r < r1; ++r)
               p->scale[r] = QuantizeRowT<V>(p->x + r * p->k, nullptr, p->k,
                                             RowOut{nullptr, p->q + r * p->k, nullptr, stream});
             if (stream) V::Fence();
           },
           keep);
}
