// What every handler and every instruction set's tiles share: the problem
// descriptions the handlers fill in, the thread pool they run on, and the
// table of one instruction set's entry points (dispatch.cc picks one).
//
// Nothing here depends on XLA: the handlers (product.cc, product_int4.cc,
// conv.cc, quantize.cc) adapt XLA's FFI to these types, and the C++ test
// program (tests/kernels_test.cc) drives the same entry points directly.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <thread>
#include <type_traits>
#include <vector>

namespace qarray::cpu {

// A pool of worker threads: XLA's intra-op pool in a handler, a plain one in
// the tests. Schedule may run the task at any later time, even after the
// call that scheduled it returned (see Parallel).
class Pool {
 public:
  virtual ~Pool() = default;
  virtual int64_t num_threads() const = 0;
  virtual void Schedule(std::function<void()> task) = 0;
};

// multiply-adds from which a call splits over the pool's threads: waking
// them costs more than their share of smaller work (make bench, suite kernels)
constexpr int64_t kParallelWork = 4 << 20;
// bytes of packed weights per panel: a panel stays in L2 while every block of
// rows passes over it
constexpr int64_t kPanelBytes = 256 << 10;
// a packed panel's step: 4 consecutive k of 16 output channels, two blocks of
// 8 channels x 4 bytes side by side (gemm.h's Panel8; AMX's tile row)
constexpr int64_t kStepBytes = 64;
// int8 parts of a float32 row at most (the tiles keep per-part state on the
// stack). Exported (dispatch.cc's qarray_cpu_max_split): qarray/_ffi.py
// refuses the library where a rule of qarray/_rules.py asks for more
constexpr int kMaxSplit = 4;
// layout kn's dot tiles: int8 rows at most (the tiles keep a row's sums on
// the stack; tiles_avx512.cc instantiates counts up to it). Exported and
// checked the same way (qarray_cpu_max_kn_dot_rows)
constexpr int64_t kMaxKnDotRows = 9;

// The thresholds that choose a path inside the kernels. Python owns them
// (qarray/_rules.py: one rule per instruction set, which also chooses
// between the kernels and XLA's formulations) and passes every one with every
// call: no defaults here, so a handler that forgot one cannot run on a
// number Python never chose.
struct Thresholds {
  int64_t split;           // int8 parts of a float32 row (weight-only)
  int64_t gemm_rows;       // int8 rows (or parts) from which the GEMM runs
  int64_t kn_dot_rows;     // layout kn: int8 rows up to which the dot tiles run
  int64_t int4_gemm_rows;  // int4 weights: rows of x from which the GEMM runs
};

// y f32[m, n] from x f32[m, k] and int8 weights with one scale per stored row
//   kn (matmul_q): q[k, n], scale[k]   y = (x * scale) @ q
//   nk (linear_q): q[n, k], scale[n]   y = (x @ q^T) * scale
// int8: x's rows (times the scales, for kn) quantized per row first
struct ProductArgs {
  int64_t m, k, n;
  bool kn, int8;
  Thresholds t;
  const float* x;
  const int8_t* q;
  const float* scale;
  float* y;
};

// y f32[m, n] = x f32[m, k] @ W^T, int4 weights W[n, k] packed two a byte
// (low nibble: even k; 4-bit two's complement) as q u8[n, k / 2], one scale
// per group of `group` values along k (a multiple of 32): scale f32[n, k / group]
struct Int4Args {
  int64_t m, k, n, group;
  bool int8;
  Thresholds t;
  const float* x;
  const uint8_t* q;
  const float* scale;
  float* y;
};

// Geometry of a convolution with up to 3 spatial axes (unused leading axes:
// size 1, kernel 1, stride 1, padding 0, dilation 1)
struct ConvGeometry {
  int64_t nsp, groups;
  int64_t k[3], stride[3], pad[3], dilation[3], in[3], out[3], padded[3];
};

// y f32[B, O, *out] = conv(x f32[B, C, *in], q s8[O, C / groups * prod(k)])
// times scale f32[O]; each example quantized as one row (int8) or split in
// parts (weight-only)
struct ConvArgs {
  ConvGeometry g;
  int64_t batch, channels, out_channels;
  bool int8;
  Thresholds t;
  const float* x;
  const int8_t* q;
  const float* scale;
  float* y;
};

// q s8[m, k], scale f32[m] = qarray.quantize(x f32[m, k]) per row
struct QuantizeArgs {
  int64_t m, k;
  const float* x;
  int8_t* q;
  float* scale;
};

// One instruction set's entry points
struct Isa {
  const char* name;
  void (*product)(Pool&, const ProductArgs&);
  void (*product_int4)(Pool&, const Int4Args&);
  void (*conv)(Pool&, const ConvArgs&);
  void (*quantize)(Pool&, const QuantizeArgs&);
  // scale = quantize_row(x * fold) into levels (float), s8 or u8 (level +
  // 128), any of them null: the row quantizer the tiles use (tests)
  float (*quantize_row)(const float* x, const float* fold, int64_t k, float* levels,
                        int8_t* s8, uint8_t* u8);
};

// std::vector's allocator on 64-byte boundaries: a panel's steps (kStepBytes)
// then each sit in one cache line
template <class T>
struct CacheAligned {
  using value_type = T;
  CacheAligned() = default;
  template <class U>
  CacheAligned(const CacheAligned<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const CacheAligned<U>&) const { return true; }
  template <class U>
  bool operator!=(const CacheAligned<U>&) const { return false; }
};

// Chunks are claimed from a shared counter by the calling thread and by the
// tasks it schedules; the caller waits only for chunks already claimed (being
// computed), never for a task that has not started, so a busy pool cannot
// deadlock it, and a task that starts late finds nothing left to do.
template <class Run>
struct Work {
  Run run;  // run(i0, i1): items [i0, i1)
  int64_t n, chunk, count;
  std::atomic<int64_t> next{0}, done{0};

  Work(Run r, int64_t n_, int64_t chunk_)
      : run(r), n(n_), chunk(chunk_), count((n_ + chunk_ - 1) / chunk_) {}

  void Drain() {
    for (int64_t c; (c = next.fetch_add(1)) < count;) {
      const int64_t i0 = c * chunk;
      run(i0, std::min(i0 + chunk, n));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// run(i0, i1) over [0, n) in chunks of `chunk` items, on up to `threads`
// threads of the pool (the calling one included). `keep` holds what run
// reads until the last task ends (a task may start after this returns).
template <class Run, class Keep>
void Parallel(Pool& pool, int64_t n, int64_t chunk, int64_t threads, Run run,
              std::shared_ptr<Keep> keep) {
  if (n <= 0) return;
  auto work = std::make_shared<Work<Run>>(run, n, chunk);
  const int64_t helpers = std::min<int64_t>(threads, work->count) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work, keep] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->count)
    std::this_thread::yield();
}

// ~`per_thread` chunks per thread, each a multiple of 64 output channels
inline int64_t ChunkSize(int64_t n, int64_t threads, int64_t per_thread) {
  int64_t chunk = (n + per_thread * threads - 1) / (per_thread * threads);
  return std::max<int64_t>(64, (chunk + 63) / 64 * 64);
}

inline int64_t Threads(const Pool& pool, int64_t work) {
  return work < kParallelWork ? 1 : std::max<int64_t>(1, pool.num_threads());
}

// The instruction sets built into this library, best first (dispatch.cc)
const Isa* Active();  // the one in use (nullptr: none runs here)
const char* ActiveReason();  // why none runs, when Active() is null
const Isa* Find(const char* name);  // by name, if built and this CPU has it
// the one after `name` among this CPU's (what an instruction set's tiles leave
// to the next: amx's to avx512's), nullptr after the last
const Isa* Below(const char* name);

}  // namespace qarray::cpu
