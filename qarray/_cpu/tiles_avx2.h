// AVX2's tile operations (quantize_row.h's vector type VecAvx2, gemm.h's int8
// tile operations I8Avx2), included inside the namespace of each file that
// builds on them, after its target pragma (tiles_avx2.cc; tiles_amx.cc, whose
// tiles take gemm.h's other paths from here), like quantize_row.h and gemm.h.
// The file includes <immintrin.h> before its namespace.

// the vector type the row quantizer (quantize_row.h) runs on
struct VecAvx2 {
  static constexpr int W = 8;
  using F = __m256;
  using M = __m256;  // lanes all ones or all zeros
  static F Load(const float* p) { return _mm256_loadu_ps(p); }
  static F Set1(float v) { return _mm256_set1_ps(v); }
  static F Zero() { return _mm256_setzero_ps(); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm256_div_ps(a, b); }
  static F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F Abs(F a) {
    return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  }
  static F Max(F a, F b) { return _mm256_max_ps(a, b); }  // NaN in a: b
  static F Min(F a, F b) { return _mm256_min_ps(a, b); }
  static F Round(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static M None() { return _mm256_setzero_ps(); }
  static M Or(M a, M b) { return _mm256_or_ps(a, b); }
  static M Unord(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_UNORD_Q); }
  static M Gt(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static bool Any(M m) { return _mm256_movemask_ps(m) != 0; }
  static F Select(M m, F a, F b) { return _mm256_blendv_ps(b, a, m); }
  static float ReduceMax(F a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  static void StoreF(float* p, F a) { _mm256_storeu_ps(p, a); }
  // 8 levels in [-127, 127] -> 8 bytes (the saturating packs change nothing)
  static __m128i Pack8(__m256i v) {
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return _mm_packs_epi16(w, w);
  }
  static void StoreS8(int8_t* p, F a) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), Pack8(_mm256_cvtps_epi32(a)));
  }
  static void StoreU8(uint8_t* p, F a) {  // level + 128 in [1, 255]
    const __m256i v = _mm256_add_epi32(_mm256_cvtps_epi32(a), _mm256_set1_epi32(128));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
  }
  // 32 levels -> 32 bytes in order: the packs work within 128-bit lanes
  // (a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7), the permutation undoes that
  static void StoreS8x4(int8_t* p, F a, F b, F c, F d, bool stream) {
    const __m256i ab = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));
    const __m256i cd = _mm256_packs_epi32(_mm256_cvtps_epi32(c), _mm256_cvtps_epi32(d));
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (stream)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), bytes);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bytes);
  }
  static void Fence() { _mm_sfence(); }
};

// gemm.h's int8 tile operations
struct I8Avx2 {
  static constexpr int kLanes = 8, kXBias = 0, kTilePairs = 1;
  static constexpr bool kPairs = false, kDotPaths = true, kTransposes = true;
  static constexpr bool kPacksPairs = false;
  // gemm.h's GEMM tiles: 4 rows in registers, any K
  static constexpr int kTileRows = 4;
  static constexpr bool kWholeTiles = false, kOwnTile = false;
  static constexpr int64_t kStepAlign = 1;
  struct Scope {};
  using Acc = __m256i;
  struct W {
    __m256i w, mag;  // the block, and its bytes' magnitudes (|-128| = 128 as u8)
  };
  static Acc Zero() { return _mm256_setzero_si256(); }
  static W LoadW(const int8_t* p) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {w, _mm256_abs_epi8(w)};
  }
  static void Dot(Acc& acc, const W& w, int32_t x4) {
    // x's bytes negated where w < 0 (zeroed where w == 0): |w| * that = w * x
    const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(x4), w.w);
    const __m256i pairs = _mm256_maddubs_epi16(w.mag, x);
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static void Store(int32_t* p, Acc a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a);
  }
  static Acc LoadAcc(const int32_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  // p = a's sums times s (plus p's values with add)
  static void ScaleInto(float* p, Acc a, const float* s, bool add) {
    const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(a), _mm256_loadu_ps(s));
    _mm256_storeu_ps(p, add ? _mm256_add_ps(_mm256_loadu_ps(p), v) : v);
  }
  // acc's lanes += four-byte dot products of the block and 32 bytes of x
  static void DotVec(Acc& acc, const W& w, const int8_t* x) {
    const __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)), w.w);
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w.mag, xs),
                                                  _mm256_set1_epi16(1)));
  }
  static int32_t Sum(Acc a) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
  }
  // float32 lanes for int4's group sums
  using FAcc = __m256;
  static FAcc FZero() { return _mm256_setzero_ps(); }
  static FAcc FmaScaled(FAcc f, Acc a, float s) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(s), f);
  }
  static float FSum(FAcc f) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  // 16 packed bytes -> a block of their 16 low nibbles' values (even k),
  // then their 16 high ones (odd k): the bytes in both lanes, the upper lane
  // shifted by 4, the low 4 bits of each byte looked up as 4-bit two's
  // complement
  static W LoadInt4W(const uint8_t* q) {
    const __m256i b =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m256i nibbles =
        _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                         _mm256_set1_epi8(0x0F));
    const __m256i table = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2,
                                           -1, 0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3,
                                           -2, -1);
    const __m256i w = _mm256_shuffle_epi8(table, nibbles);
    return {w, _mm256_abs_epi8(w)};
  }
  static void Prefetch(const int8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
  // 8 rows (ld apart) of k int8 (k a multiple of 32) -> k / 4 blocks: an 8 x 8
  // transpose of 4-byte groups per 32 k
  static void PackNk8(const int8_t* rows, int64_t ld, int64_t k, int8_t* dst, int64_t stride) {
    for (int64_t i = 0; i < k; i += 32) {
      __m256i r[8], t[8], u[8];
      for (int c = 0; c < 8; ++c)
        r[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + c * ld + i));
      for (int c = 0; c < 8; c += 2) {
        t[c] = _mm256_unpacklo_epi32(r[c], r[c + 1]);
        t[c + 1] = _mm256_unpackhi_epi32(r[c], r[c + 1]);
      }
      for (int h = 0; h < 8; h += 4) {  // u[h + e]: group e (and e + 4) of rows h..h+3
        u[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
        u[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
        u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
        u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
      }
      for (int e = 0; e < 4; ++e) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (i / 4 + e) * stride),
                            _mm256_permute2x128_si256(u[e], u[4 + e], 0x20));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (i / 4 + e + 4) * stride),
                            _mm256_permute2x128_si256(u[e], u[4 + e], 0x31));
      }
    }
  }
  // 32 columns from j of four kn rows -> four blocks (columns 0-7, ..., 24-31)
  // of 4-byte groups (the rows' bytes of a column interleaved)
  static void KnQuads(const int8_t* const* r, int64_t j, int8_t (*out)[32]) {
    __m256i v[4];
    for (int t = 0; t < 4; ++t)
      v[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[t] + j));
    // within 128-bit lanes: lo01 holds columns 0-7 | 16-23, hi01 8-15 | 24-31
    const __m256i lo01 = _mm256_unpacklo_epi8(v[0], v[1]), hi01 = _mm256_unpackhi_epi8(v[0], v[1]);
    const __m256i lo23 = _mm256_unpacklo_epi8(v[2], v[3]), hi23 = _mm256_unpackhi_epi8(v[2], v[3]);
    const __m256i a = _mm256_unpacklo_epi16(lo01, lo23);  // 0-3 | 16-19
    const __m256i b = _mm256_unpackhi_epi16(lo01, lo23);  // 4-7 | 20-23
    const __m256i c = _mm256_unpacklo_epi16(hi01, hi23);  // 8-11 | 24-27
    const __m256i d = _mm256_unpackhi_epi16(hi01, hi23);  // 12-15 | 28-31
    _mm256_store_si256(reinterpret_cast<__m256i*>(out[0]), _mm256_permute2x128_si256(a, b, 0x20));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out[1]), _mm256_permute2x128_si256(c, d, 0x20));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out[2]), _mm256_permute2x128_si256(a, b, 0x31));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out[3]), _mm256_permute2x128_si256(c, d, 0x31));
  }
  // 8 rows of 8 floats (in, ld_in apart) transposed: their columns [0, cols)
  // to out + j * ld_out
  static void Transpose8Out(const float* in, int64_t ld_in, int64_t cols, float* out,
                            int64_t ld_out) {
    __m256 r[8], t[8], s[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(in + i * ld_in);
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
    if (cols == 8) {  // constant indices: r stays in registers
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + j * ld_out, r[j]);
    } else {
      for (int j = 0; j < cols; ++j) _mm256_storeu_ps(out + j * ld_out, r[j]);
    }
  }
  // 16 rows of 16 bytes (src, ld_src apart) transposed: dst's row j (ld_dst
  // apart) holds byte j of every row, through unpacks of ever wider units
  static void Transpose16x16(const int8_t* src, int64_t ld_src, int8_t* dst, int64_t ld_dst) {
    __m128i r[16], a[16], b[16], c[16];
    for (int i = 0; i < 16; ++i)
      r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * ld_src));
    for (int i = 0; i < 8; ++i) {  // 16-bit units: rows 2i, 2i + 1 at one column
      a[2 * i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
      a[2 * i + 1] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i)  // 32-bit units: rows 4i .. 4i + 3
      for (int h = 0; h < 2; ++h) {
        b[4 * i + 2 * h] = _mm_unpacklo_epi16(a[4 * i + h], a[4 * i + 2 + h]);
        b[4 * i + 2 * h + 1] = _mm_unpackhi_epi16(a[4 * i + h], a[4 * i + 2 + h]);
      }
    for (int i = 0; i < 2; ++i)  // 64-bit units: rows 8i .. 8i + 7
      for (int t = 0; t < 4; ++t) {
        c[8 * i + 2 * t] = _mm_unpacklo_epi32(b[8 * i + t], b[8 * i + 4 + t]);
        c[8 * i + 2 * t + 1] = _mm_unpackhi_epi32(b[8 * i + t], b[8 * i + 4 + t]);
      }
    for (int u = 0; u < 8; ++u) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * u * ld_dst),
                       _mm_unpacklo_epi64(c[u], c[8 + u]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * u + 1) * ld_dst),
                       _mm_unpackhi_epi64(c[u], c[8 + u]));
    }
  }
  // 16 packed bytes -> their 32 int4 values as int8 in k order (low nibble
  // first), sign-extended by a table lookup
  static void Int4Row(const uint8_t* q, int8_t* out) {
    const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(b, low4));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), low4));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_unpacklo_epi8(lo, hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm_unpackhi_epi8(lo, hi));
  }
};
