// qarray_product: matmul_q / linear_q with int8 weights (common.h's
// ProductArgs), weight-only or W8A8, on the instruction set dispatch.cc chose.
#include "handler.h"

namespace qarray::cpu {
namespace {

ffi::Error ProductImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                       ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                       ffi::ResultBuffer<ffi::F32> y, int64_t kn, int64_t int8,
                       int64_t split, int64_t gemm_rows, int64_t kn_dot_rows,
                       int64_t int4_gemm_rows) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 1)
    return ffi::Error::InvalidArgument(
        "qarray_product takes x[M, K], q of rank 2 and scale of rank 1");
  ProductArgs a;
  a.m = xd[0];
  a.k = xd[1];
  a.n = kn ? qd[1] : qd[0];
  a.kn = kn != 0;
  a.int8 = int8 != 0;
  if ((kn ? qd[0] : qd[1]) != a.k || sd[0] != (kn ? a.k : a.n))
    return ffi::Error::InvalidArgument("qarray_product: x, q and scale do not match");
  return RunProduct("qarray_product", pool, &Isa::product, a,
                    Thresholds{split, gemm_rows, kn_dot_rows, int4_gemm_rows}, x, q, scale, y);
}

}  // namespace
}  // namespace qarray::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(QarrayProduct, qarray::cpu::ProductImpl,
                              qarray::cpu::BindThresholds(
                                  qarray::cpu::BindProduct<xla::ffi::S8>()
                                      .Attr<int64_t>("kn")
                                      .Attr<int64_t>("int8")));
