// qarray_product_int4: linear_q with packed int4 weights (common.h's
// Int4Args), weight-only or W4A8, on the instruction set dispatch.cc chose.
#include "handler.h"

namespace qarray::cpu {
namespace {

ffi::Error ProductInt4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::F32> scale,
                           ffi::ResultBuffer<ffi::F32> y, int64_t int8, int64_t split,
                           int64_t gemm_rows, int64_t kn_dot_rows, int64_t int4_gemm_rows) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument(
        "qarray_product_int4 takes x[M, K], q[N, K / 2] and scale[N, K / G]");
  Int4Args a;
  a.m = xd[0];
  a.k = xd[1];
  a.n = qd[0];
  if (qd[1] * 2 != a.k || sd[0] != a.n || sd[1] == 0 || a.k % sd[1])
    return ffi::Error::InvalidArgument("qarray_product_int4: shapes do not match");
  a.group = a.k / sd[1];
  if (a.group % 32)
    return ffi::Error::InvalidArgument("qarray_product_int4: group size % 32 != 0");
  a.int8 = int8 != 0;
  return RunProduct("qarray_product_int4", pool, &Isa::product_int4, a,
                    Thresholds{split, gemm_rows, kn_dot_rows, int4_gemm_rows}, x, q, scale, y);
}

}  // namespace
}  // namespace qarray::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(QarrayProductInt4, qarray::cpu::ProductInt4Impl,
                              qarray::cpu::BindThresholds(
                                  qarray::cpu::BindProduct<xla::ffi::U8>()
                                      .Attr<int64_t>("int8")));
