// What the four FFI handlers share: XLA's intra-op thread pool as a Pool, the
// thresholds Python passes with every call, checked, and the instruction set
// that runs (dispatch.cc).
#pragma once

#include <string>
#include <utility>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace qarray::cpu {

namespace ffi = xla::ffi;

class FfiPool final : public Pool {
 public:
  explicit FfiPool(ffi::ThreadPool& pool) : pool_(pool) {}
  int64_t num_threads() const override { return pool_.num_threads(); }
  void Schedule(std::function<void()> task) override { pool_.Schedule(std::move(task)); }

 private:
  ffi::ThreadPool& pool_;
};

// The operands of every product handler (product, product_int4, conv): XLA's
// pool, x f32, the weights (W: S8, or U8 for packed int4), their scales f32
// -> y f32; the handler's own attributes follow
template <ffi::DataType W>
auto BindProduct() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<W>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

// The thresholds every product handler binds, in Thresholds' order, after
// its own attributes (each is passed all of them: qarray/_ffi.py's
// thresholds())
template <class Binding>
auto BindThresholds(Binding binding) {
  return std::move(binding)
      .template Attr<int64_t>("split")
      .template Attr<int64_t>("gemm_rows")
      .template Attr<int64_t>("kn_dot_rows")
      .template Attr<int64_t>("int4_gemm_rows");
}

// The tiles keep up to kMaxSplit parts a row; a row count below 1 would turn
// a path off by accident
inline ffi::Error CheckThresholds(const char* handler, const Thresholds& t) {
  if (t.split < 1 || t.split > kMaxSplit || t.gemm_rows < 1 || t.kn_dot_rows < 0 ||
      t.kn_dot_rows > kMaxKnDotRows || t.int4_gemm_rows < 1)
    return ffi::Error::InvalidArgument(
        std::string(handler) + ": thresholds out of range (split 1-" +
        std::to_string(kMaxSplit) + ", gemm_rows >= 1, kn_dot_rows 0-" +
        std::to_string(kMaxKnDotRows) + ", int4_gemm_rows >= 1)");
  return ffi::Error::Success();
}

// What every handler ends with: the instruction set in use runs its `entry`
// (&Isa::product, product_int4, conv or quantize) on XLA's pool, or the
// handler fails where none runs (qarray/_ffi.py registers the handlers only
// where one does)
template <class Args>
ffi::Error RunOnIsa(const char* handler, ffi::ThreadPool& pool,
                    void (*Isa::*entry)(Pool&, const Args&), const Args& a) {
  const Isa* isa = Active();
  if (!isa) return ffi::Error::Internal(std::string(handler) + ": " + ActiveReason());
  FfiPool p(pool);
  (isa->*entry)(p, a);
  return ffi::Error::Success();
}

// What every product handler ends with, its shapes checked: the thresholds
// Python passed, checked, the buffers, and RunOnIsa
template <class Args, class Q>
ffi::Error RunProduct(const char* handler, ffi::ThreadPool& pool,
                      void (*Isa::*entry)(Pool&, const Args&), Args& a, const Thresholds& t,
                      ffi::Buffer<ffi::F32> x, Q q, ffi::Buffer<ffi::F32> scale,
                      ffi::ResultBuffer<ffi::F32> y) {
  a.t = t;
  if (auto e = CheckThresholds(handler, a.t); e.failure()) return e;
  a.x = x.typed_data();
  a.q = q.typed_data();
  a.scale = scale.typed_data();
  a.y = y->typed_data();
  return RunOnIsa(handler, pool, entry, a);
}

}  // namespace qarray::cpu
