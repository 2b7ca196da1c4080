// Every handler of qarray's CPU kernels against a plain C++ reference, on odd
// shapes, for each instruction set this CPU runs (or the one QARRAY_CPU_ISA
// names): the tiles' entry points (common.h's Isa table) driven directly, on a
// small thread pool of their own, without XLA.
//
//   make test-kernels        (x86-64, natively)
//   make test-kernels-arm    (aarch64, cross-built, under qemu-aarch64 -cpu max)
//
// The references: the row quantizer with _numerics.py's numerics written
// element by element (bit-exact: levels and scales must match); W8A8 products
// as integer sums of those levels times the scales, in double (the kernels'
// int32 sums are exact, so only the final float32 multiplications differ);
// weight-only products in double against float32 x, within a bound relative
// to sum |x w| (the split parts keep x to ~1e-7 of its row's largest entry).
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <random>
#include <string>

#include "common.h"

using namespace qarray::cpu;

namespace {

class ThreadPool final : public Pool {
 public:
  explicit ThreadPool(int n) {
    for (int i = 0; i < n; ++i) workers_.emplace_back([this] { Loop(); });
  }
  ~ThreadPool() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }
  int64_t num_threads() const override { return static_cast<int64_t>(workers_.size()); }
  void Schedule(std::function<void()> task) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }
  std::vector<std::thread> workers_;
  std::deque<std::function<void()>> tasks_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
};

int failures = 0;
std::string current;  // the case being checked

void Fail(const char* what, double got, double want, int64_t at) {
  if (failures < 20)
    std::printf("  FAIL %s: %s at %lld: got %.9g, want %.9g\n", current.c_str(), what,
                static_cast<long long>(at), got, want);
  ++failures;
}

// --- references

float RefQuantizeRow(const float* x, const float* fold, int64_t k, int8_t* q) {
  float amax = 0.0f;
  bool nan = false;
  std::vector<float> v(k);
  for (int64_t i = 0; i < k; ++i) {
    v[i] = fold ? x[i] * fold[i] : x[i];
    if (std::isnan(v[i])) nan = true;
    amax = std::max(amax, std::fabs(v[i]));
  }
  const float scale = nan ? NAN : amax * (1.0f / 127.0f);
  const float d = scale > 0.0f ? scale : 1.0f;
  for (int64_t i = 0; i < k; ++i) {
    float t = std::nearbyint(v[i] / d);  // round half to even (default mode)
    if (std::isnan(t)) t = 0.0f;
    q[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, t)));
  }
  return scale;
}

std::vector<float> Random(std::mt19937& rng, int64_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& e : v) e = u(rng);
  return v;
}

std::vector<int8_t> RandomQ(std::mt19937& rng, int64_t n, int lo = -127) {
  std::uniform_int_distribution<int> u(lo, 127);
  std::vector<int8_t> v(n);
  for (auto& e : v) e = static_cast<int8_t>(u(rng));
  return v;
}

bool Close(double got, double want, double tol) {
  return std::fabs(got - want) <= tol || (std::isnan(got) && std::isnan(want));
}

// --- checks

// the thresholds the checks start from (the kernels have none of their own:
// Python passes its rule's, qarray/_rules.py); each check also forces every
// path with others
constexpr Thresholds kThresholds{3, 8, 9, 2};

void CheckQuantize(const Isa& isa, Pool& pool, std::mt19937& rng) {
  for (int64_t k : {1, 7, 8, 16, 31, 33, 64, 100, 1000, 4099}) {
    for (int kind = 0; kind < 6; ++kind) {
      const int64_t m = 3;
      std::vector<float> x = Random(rng, m * k, -3.0f, 3.0f);
      if (kind == 1) std::fill(x.begin(), x.begin() + k, 0.0f);  // an all-zero row
      if (kind == 2) x[k / 2] = NAN;                              // a NaN row
      if (kind == 3) x[k - 1] = INFINITY;                         // an inf row
      if (kind == 4)
        for (int64_t i = 0; i < k; ++i) x[i] *= 1e-40f;  // subnormal: 1 / scale overflows
      if (kind == 5)  // exact half-integers of the row's scale: round half to even
        for (int64_t i = 0; i < k; ++i) x[i] = (i == 0 ? 127.0f : (i % 9) - 4.5f) * 0.25f;
      std::vector<int8_t> q(m * k), want(k);
      std::vector<float> scale(m);
      QuantizeArgs a{m, k, x.data(), q.data(), scale.data()};
      current = std::string(isa.name) + " quantize k=" + std::to_string(k) + " kind=" +
                std::to_string(kind);
      isa.quantize(pool, a);
      for (int64_t r = 0; r < m; ++r) {
        const float s = RefQuantizeRow(x.data() + r * k, nullptr, k, want.data());
        if (!(s == scale[r] || (std::isnan(s) && std::isnan(scale[r]))))
          Fail("scale", scale[r], s, r);
        for (int64_t i = 0; i < k; ++i)
          if (q[r * k + i] != want[i]) Fail("level", q[r * k + i], want[i], r * k + i);
      }
      // the tiles' row quantizer, folded, to u8 (level + 128) and float levels
      std::vector<float> fold = Random(rng, k, 0.5f, 2.0f), levels(k);
      std::vector<uint8_t> u8(k);
      const float s = isa.quantize_row(x.data(), fold.data(), k, levels.data(), nullptr,
                                       u8.data());
      const float ws = RefQuantizeRow(x.data(), fold.data(), k, want.data());
      if (!(s == ws || (std::isnan(s) && std::isnan(ws)))) Fail("folded scale", s, ws, 0);
      for (int64_t i = 0; i < k; ++i) {
        if (levels[i] != want[i]) Fail("folded level", levels[i], want[i], i);
        if (u8[i] != want[i] + 128) Fail("u8 level", u8[i], want[i] + 128, i);
      }
    }
  }
}

void CheckProduct(const Isa& isa, Pool& pool, std::mt19937& rng) {
  struct Shape {
    int64_t m, k, n;
  };
  const Shape shapes[] = {{1, 1, 1},     {1, 7, 5},      {2, 33, 17},   {3, 64, 64},
                          {4, 100, 70},  {5, 256, 129},  {8, 40, 33},   {9, 257, 31},
                          {13, 130, 300}, {37, 64, 48},  {64, 300, 96},
                          // over the pool's threads (4M multiply-adds and more;
                          // x quantized on them from 2^18 elements)
                          {1, 2048, 700}, {20, 512, 410}, {520, 512, 24}};
  // the usual thresholds, every path forced to the GEMM, and two parts a row
  const Thresholds thresholds[] = {kThresholds, Thresholds{3, 1, 0, 2}, Thresholds{2, 8, 9, 2}};
  for (const Shape& sh : shapes)
    for (const Thresholds& t : thresholds)
      for (int kn = 0; kn < 2; ++kn)
        // the big shapes for the threads, once (qemu runs this too)
        if (sh.m * sh.k * sh.n < (1 << 20) || t.split == 3)
        for (int int8 = 0; int8 < 2; ++int8) {
          const int64_t m = sh.m, k = sh.k, n = sh.n;
          std::vector<float> x = Random(rng, m * k);
          // one weight -128 (pack() takes any int8): the sign tricks must hold
          std::vector<int8_t> q = RandomQ(rng, k * n, -128);
          std::vector<float> scale = Random(rng, kn ? k : n, 0.001f, 0.02f);
          std::vector<float> y(m * n, NAN);
          ProductArgs a{m, k, n, kn != 0, int8 != 0, t, x.data(), q.data(), scale.data(), y.data()};
          current = std::string(isa.name) + " product " + (kn ? "kn" : "nk") +
                    (int8 ? " W8A8" : " weight-only") + " (" + std::to_string(m) + ", " +
                    std::to_string(k) + ", " + std::to_string(n) + ") split " +
                    std::to_string(t.split) + " gemm_rows " + std::to_string(t.gemm_rows);
          isa.product(pool, a);
          auto w = [&](int64_t i, int64_t j) {  // q's entry for k index i, column j
            return static_cast<double>(kn ? q[i * n + j] : q[j * k + i]);
          };
          std::vector<int8_t> xq(k);
          for (int64_t r = 0; r < m; ++r) {
            const float* xr = x.data() + r * k;
            float sx = 0.0f;
            if (int8) sx = RefQuantizeRow(xr, kn ? scale.data() : nullptr, k, xq.data());
            double row_max = 0.0;  // of v = x (times the scales, for kn)
            for (int64_t i = 0; i < k; ++i)
              row_max = std::max(row_max, std::fabs(static_cast<double>(xr[i]) * (kn ? scale[i] : 1.0)));
            for (int64_t j = 0; j < n; ++j) {
              double want = 0.0, bound = 0.0, split = 0.0;
              for (int64_t i = 0; i < k; ++i) {
                const double s = kn ? scale[i] : scale[j];
                if (int8) {
                  want += xq[i] * w(i, j);
                } else {
                  want += static_cast<double>(xr[i]) * s * w(i, j);
                  bound += std::fabs(static_cast<double>(xr[i]) * s * w(i, j));
                  // each part quantizes what the previous left: the last
                  // leaves at most half its scale, ~|v|max / (127 254^(split-1))
                  split += std::fabs((kn ? 1.0 : s) * w(i, j)) * row_max /
                           (2.0 * 127.0 * std::pow(254.0, t.split - 1));
                }
              }
              if (int8) {
                want *= static_cast<double>(sx) * (kn ? 1.0 : scale[j]);
                bound = std::fabs(want);
              }
              const double tol = (int8 ? 1e-6 : 2e-6) * bound + 1.01 * split + 1e-30;
              if (!Close(y[r * n + j], want, tol)) Fail("y", y[r * n + j], want, r * n + j);
            }
          }
        }
}

void CheckInt4(const Isa& isa, Pool& pool, std::mt19937& rng) {
  struct Shape {
    int64_t m, k, n, group;
  };
  const Shape shapes[] = {{1, 32, 5, 32},    {2, 64, 17, 32},   {3, 256, 33, 64},
                          {5, 128, 40, 128}, {17, 96, 9, 32},   {1, 2048, 300, 128},
                          {24, 512, 70, 256}, {520, 512, 24, 128}};
  // the GEMM from 2 rows (kThresholds'), at every row count, or never
  const int64_t switches[] = {kThresholds.int4_gemm_rows, 1, 1 << 20};
  for (const Shape& sh : shapes)
    for (int64_t gemm_rows : switches)
    for (int int8 = 0; int8 < 2; ++int8) {
      const int64_t m = sh.m, k = sh.k, n = sh.n, groups = k / sh.group;
      Thresholds t = kThresholds;
      t.int4_gemm_rows = gemm_rows;
      std::vector<float> x = Random(rng, m * k);
      std::vector<uint8_t> q(n * k / 2);
      std::uniform_int_distribution<int> byte(0, 255);
      for (auto& b : q) b = static_cast<uint8_t>(byte(rng));
      std::vector<float> scale = Random(rng, n * groups, 0.001f, 0.02f);
      std::vector<float> y(m * n, NAN);
      Int4Args a{m, k, n, sh.group, int8 != 0, t, x.data(), q.data(), scale.data(), y.data()};
      current = std::string(isa.name) + " int4" + (int8 ? " W4A8" : " weight-only") + " (" +
                std::to_string(m) + ", " + std::to_string(k) + ", " + std::to_string(n) +
                ") group " + std::to_string(sh.group) + ", GEMM from " +
                std::to_string(gemm_rows) + " rows";
      isa.product_int4(pool, a);
      auto w = [&](int64_t j, int64_t i) {  // W[j, i]: 4-bit two's complement
        const int v = (q[j * (k / 2) + i / 2] >> (4 * (i % 2))) & 0xF;
        return static_cast<double>(v >= 8 ? v - 16 : v) * scale[j * groups + i / sh.group];
      };
      std::vector<int8_t> xq(k);
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = x.data() + r * k;
        const float sx = int8 ? RefQuantizeRow(xr, nullptr, k, xq.data()) : 1.0f;
        for (int64_t j = 0; j < n; ++j) {
          double want = 0.0, bound = 0.0;
          for (int64_t i = 0; i < k; ++i) {
            const double v = (int8 ? xq[i] * static_cast<double>(sx) : xr[i]) * w(j, i);
            want += v;
            bound += std::fabs(v);
          }
          if (!Close(y[r * n + j], want, 2e-6 * bound + 1e-30))
            Fail("y", y[r * n + j], want, r * n + j);
        }
      }
    }
}

void CheckConv(const Isa& isa, Pool& pool, std::mt19937& rng) {
  struct Case {
    int64_t nsp, batch, channels, out_channels, groups;
    int64_t in[3], k[3], stride[3], pad[3], dilation[3];
  };
  // unused leading axes: size 1, kernel 1, stride 1, padding 0, dilation 1
  const Case cases[] = {
      {1, 2, 3, 5, 1, {1, 1, 17}, {1, 1, 3}, {1, 1, 1}, {0, 0, 1}, {1, 1, 1}},
      {1, 1, 8, 40, 2, {1, 1, 30}, {1, 1, 4}, {1, 1, 3}, {0, 0, 2}, {1, 1, 2}},
      {2, 2, 3, 17, 1, {1, 9, 11}, {1, 3, 3}, {1, 1, 2}, {0, 1, 0}, {1, 1, 1}},
      {2, 1, 6, 6, 3, {1, 7, 7}, {1, 2, 3}, {1, 2, 1}, {0, 0, 1}, {1, 2, 1}},
      {2, 3, 16, 33, 1, {1, 12, 10}, {1, 3, 3}, {1, 1, 1}, {0, 1, 1}, {1, 1, 1}},
      {3, 1, 4, 9, 1, {5, 6, 7}, {2, 3, 2}, {1, 2, 1}, {1, 0, 1}, {1, 1, 2}},
      {1, 2, 64, 128, 1, {1, 1, 100}, {1, 1, 1}, {1, 1, 1}, {0, 0, 0}, {1, 1, 1}},
      // 32 channels a group and more, 256 or more a tile's K (AMX's tiles:
      // each offset's channels padded to 64; lines not a multiple of 16 rows)
      {2, 2, 40, 20, 1, {1, 9, 13}, {1, 3, 3}, {1, 1, 2}, {0, 1, 1}, {1, 1, 1}},
      {1, 1, 64, 24, 2, {1, 1, 37}, {1, 1, 5}, {1, 1, 1}, {0, 0, 2}, {1, 1, 2}},
      {3, 1, 33, 7, 1, {3, 4, 5}, {2, 2, 2}, {1, 1, 1}, {1, 0, 1}, {1, 1, 1}},
      {2, 1, 96, 48, 1, {1, 5, 18}, {1, 3, 3}, {1, 1, 1}, {0, 1, 1}, {1, 1, 1}},
  };
  for (const Case& cs : cases)
    for (int int8 = 0; int8 < 2; ++int8) {
      ConvArgs a;
      a.t = kThresholds;
      ConvGeometry& g = a.g;
      g.nsp = cs.nsp;
      g.groups = cs.groups;
      for (int i = 0; i < 3; ++i) {
        g.k[i] = cs.k[i];
        g.stride[i] = cs.stride[i];
        g.pad[i] = cs.pad[i];
        g.dilation[i] = cs.dilation[i];
        g.in[i] = cs.in[i];
        // symmetric padding: out = (in + 2 pad - dilation (k - 1) - 1) / stride + 1
        g.out[i] = (cs.in[i] + 2 * cs.pad[i] - cs.dilation[i] * (cs.k[i] - 1) - 1) / cs.stride[i] + 1;
        g.padded[i] = std::max(g.pad[i] + g.in[i],
                               (g.out[i] - 1) * g.stride[i] + (g.k[i] - 1) * g.dilation[i] + 1);
      }
      a.batch = cs.batch;
      a.channels = cs.channels;
      a.out_channels = cs.out_channels;
      a.int8 = int8 != 0;
      const int64_t cg = cs.channels / cs.groups, og = cs.out_channels / cs.groups;
      const int64_t offsets = g.k[0] * g.k[1] * g.k[2];
      const int64_t plane = g.in[0] * g.in[1] * g.in[2];
      const int64_t positions = g.out[0] * g.out[1] * g.out[2];
      std::vector<float> x = Random(rng, cs.batch * cs.channels * plane);
      std::vector<int8_t> q = RandomQ(rng, cs.out_channels * cg * offsets);
      std::vector<float> scale = Random(rng, cs.out_channels, 0.001f, 0.02f);
      std::vector<float> y(cs.batch * cs.out_channels * positions, NAN);
      a.x = x.data();
      a.q = q.data();
      a.scale = scale.data();
      a.y = y.data();
      current = std::string(isa.name) + " conv " + std::to_string(cs.nsp) + "-D" +
                (int8 ? " W8A8" : " weight-only") + " C=" + std::to_string(cs.channels) +
                " O=" + std::to_string(cs.out_channels) + " groups " + std::to_string(cs.groups);
      isa.conv(pool, a);
      const int64_t example = cs.channels * plane;
      std::vector<int8_t> xq(example);
      for (int64_t b = 0; b < cs.batch; ++b) {
        const float* xb = x.data() + b * example;
        const float sx = int8 ? RefQuantizeRow(xb, nullptr, example, xq.data()) : 1.0f;
        for (int64_t o = 0; o < cs.out_channels; ++o)
          for (int64_t o0 = 0; o0 < g.out[0]; ++o0)
            for (int64_t o1 = 0; o1 < g.out[1]; ++o1)
              for (int64_t o2 = 0; o2 < g.out[2]; ++o2) {
                double want = 0.0, bound = 0.0;
                const int64_t gi = o / og;
                for (int64_t c = 0; c < cg; ++c)
                  for (int64_t i0 = 0; i0 < g.k[0]; ++i0)
                    for (int64_t i1 = 0; i1 < g.k[1]; ++i1)
                      for (int64_t i2 = 0; i2 < g.k[2]; ++i2) {
                        const int64_t p0 = o0 * g.stride[0] + i0 * g.dilation[0] - g.pad[0];
                        const int64_t p1 = o1 * g.stride[1] + i1 * g.dilation[1] - g.pad[1];
                        const int64_t p2 = o2 * g.stride[2] + i2 * g.dilation[2] - g.pad[2];
                        if (p0 < 0 || p1 < 0 || p2 < 0 || p0 >= g.in[0] || p1 >= g.in[1] ||
                            p2 >= g.in[2])
                          continue;
                        const int64_t at = ((gi * cg + c) * g.in[0] + p0) * g.in[1] * g.in[2] +
                                           p1 * g.in[2] + p2;
                        const double xv = int8 ? xq[at] * static_cast<double>(sx) : xb[at];
                        const double v =
                            xv * q[((o * cg + c) * g.k[0] + i0) * g.k[1] * g.k[2] +
                                   i1 * g.k[2] + i2] * scale[o];
                        want += v;
                        bound += std::fabs(v);
                      }
                const int64_t at = ((b * cs.out_channels + o) * g.out[0] + o0) * g.out[1] *
                                       g.out[2] + o1 * g.out[2] + o2;
                if (!Close(y[at], want, 2e-6 * bound + 1e-30)) Fail("y", y[at], want, at);
              }
      }
    }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--list") {  // what this CPU runs, best first
    for (const char* name : {"amx", "avx512", "avxvnni", "avx2", "i8mm", "dotprod"})
      if (Find(name)) std::printf("%s\n", name);
    return 0;
  }
  const char* forced = std::getenv("QARRAY_CPU_ISA");
  std::vector<const Isa*> isas;
  if (forced && *forced) {
    if (!Active()) {
      std::printf("kernels_test: %s\n", ActiveReason());
      return 1;
    }
    isas.push_back(Active());
  } else {
    for (const char* name : {"amx", "avx512", "avxvnni", "avx2", "i8mm", "dotprod"})
      if (const Isa* isa = Find(name)) isas.push_back(isa);
  }
  if (isas.empty()) {
    std::printf("kernels_test: no instruction set of this build runs on this CPU (%s)\n",
                ActiveReason());
    return 1;
  }
  ThreadPool pool(3);
  for (const Isa* isa : isas) {
    const int before = failures;
    std::mt19937 rng(20240537);
    CheckQuantize(*isa, pool, rng);
    CheckProduct(*isa, pool, rng);
    CheckInt4(*isa, pool, rng);
    CheckConv(*isa, pool, rng);
    std::printf("kernels_test: isa %s: %s (%d failures)\n", isa->name,
                failures == before ? "every handler matches the reference" : "FAILED",
                failures - before);
  }
  return failures ? 1 : 0;
}
