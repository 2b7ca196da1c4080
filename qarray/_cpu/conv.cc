// qarray_conv: conv_q with int8 weights as an implicit GEMM (common.h's
// ConvArgs), weight-only or W8A8, on the instruction set dispatch.cc chose.
#include "handler.h"

namespace qarray::cpu {
namespace {

ffi::Error ConvImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                    ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                    ffi::ResultBuffer<ffi::F32> y, ffi::Span<const int64_t> geometry,
                    int64_t int8, int64_t split, int64_t gemm_rows, int64_t kn_dot_rows,
                    int64_t int4_gemm_rows) {
  auto xd = x.dimensions(), qd = q.dimensions(), yd = y->dimensions();
  if (geometry.size() != 13 || xd.size() < 3 || xd.size() > 5 || qd.size() != 2 ||
      yd.size() != xd.size())
    return ffi::Error::InvalidArgument("qarray_conv: bad geometry or ranks");
  ConvArgs a;
  ConvGeometry& g = a.g;
  g.nsp = static_cast<int64_t>(xd.size()) - 2;
  g.groups = geometry[12];
  // geometry: kernel sizes, strides, low paddings, dilations (three each,
  // unused leading axes 1, 1, 0, 1), then the group count
  for (int i = 0; i < 3; ++i) {
    const int j = i - (3 - static_cast<int>(g.nsp));  // the spatial axis, if used
    g.k[i] = geometry[i];
    g.stride[i] = geometry[3 + i];
    g.pad[i] = geometry[6 + i];
    g.dilation[i] = geometry[9 + i];
    g.in[i] = j >= 0 ? xd[2 + j] : 1;
    g.out[i] = j >= 0 ? yd[2 + j] : 1;
    if (g.k[i] < 1 || g.stride[i] < 1 || g.pad[i] < 0 || g.dilation[i] < 1)
      return ffi::Error::InvalidArgument("qarray_conv: bad geometry");
    // every position any window reads (a high padding past what the input
    // covers is read as zeros too)
    g.padded[i] = std::max(g.pad[i] + g.in[i],
                           (g.out[i] - 1) * g.stride[i] + (g.k[i] - 1) * g.dilation[i] + 1);
  }
  a.batch = xd[0];
  a.channels = xd[1];
  a.out_channels = qd[0];
  const int64_t offsets = g.k[0] * g.k[1] * g.k[2];
  if (g.groups < 1 || a.channels % g.groups || a.out_channels % g.groups ||
      qd[1] != a.channels / g.groups * offsets || yd[0] != a.batch ||
      yd[1] != a.out_channels || scale.element_count() != a.out_channels)
    return ffi::Error::InvalidArgument("qarray_conv: shapes do not match");
  a.int8 = int8 != 0;
  return RunProduct("qarray_conv", pool, &Isa::conv, a,
                    Thresholds{split, gemm_rows, kn_dot_rows, int4_gemm_rows}, x, q, scale, y);
}

}  // namespace
}  // namespace qarray::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(QarrayConv, qarray::cpu::ConvImpl,
                              qarray::cpu::BindThresholds(
                                  qarray::cpu::BindProduct<xla::ffi::S8>()
                                      .Attr<xla::ffi::Span<const int64_t>>("geometry")
                                      .Attr<int64_t>("int8")));
