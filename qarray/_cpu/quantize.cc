// qarray_quantize: qarray.quantize's int8 rows (quantize_row.h's numerics),
// x f32[M, K] -> q s8[M, K], scale f32[M], each row read from memory once.
#include "handler.h"

namespace qarray::cpu {
namespace {

ffi::Error QuantizeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::ResultBuffer<ffi::S8> q, ffi::ResultBuffer<ffi::F32> scale) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("qarray_quantize takes x[M, K]");
  QuantizeArgs a{xd[0], xd[1], x.typed_data(), q->typed_data(), scale->typed_data()};
  return RunOnIsa("qarray_quantize", pool, &Isa::quantize, a);
}

}  // namespace
}  // namespace qarray::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(QarrayQuantize, qarray::cpu::QuantizeImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S8>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());
