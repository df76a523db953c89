#include "ops.h"

#include <atomic>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "kernels.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "pool.h"
#include "row_ops.h"

namespace mlxcel_native {
namespace {

std::atomic<bool> generic_forced{false};

// The best instruction set this CPU runs the kernels with.
Isa cpu_isa() {
#if defined(__x86_64__)
  static const Isa isa = [] {
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq");
    return avx512 ? Isa::avx512 : avx2 ? Isa::avx2 : Isa::generic;
  }();
  return isa;
#else
  return Isa::generic;
#endif
}

constexpr const char* kIsaNames[] = {"generic", "avx2", "avx512"};

int isa_from_name(const std::string& name) {
  for (int i = 0; i < 3; ++i)
    if (name == kIsaNames[i]) return i;
  return -1;
}

// The cap on the instruction set (set_isa_cap): MLXCEL_NATIVE_ISA at start, read once, so
// that a CPU with AVX-512 can run and measure the AVX2 kernels. Unknown values cap nothing.
std::atomic<int> isa_cap{[] {
  const char* env = std::getenv("MLXCEL_NATIVE_ISA");
  const int cap = env ? isa_from_name(env) : -1;
  return cap >= 0 ? cap : int(Isa::avx512);
}()};

std::atomic<int> int8_wanted{0};  // an Int8Mode

bool cpu_has_vnni() {
#if defined(__x86_64__)
  static const bool ok = cpu_isa() == Isa::avx512 && __builtin_cpu_supports("avx512vnni");
  return ok;
#else
  return false;
#endif
}

// Which quantized matmuls quantise their activations to int8 (kernels_vnni.cpp) rather than
// widen the weights to float32: none without AVX512-VNNI or below the AVX-512 kernels (AVX2
// has no int8 kernels yet).
int int8_mode() {
  if (active_isa() != Isa::avx512 || !cpu_has_vnni()) return int(Int8Mode::off);
  return int8_wanted.load(std::memory_order_relaxed);
}

// Below this many multiply-adds a call runs on the calling thread alone. While mlx evaluates,
// its main thread keeps encoding the graph as the stream's thread computes, so on a 2-core
// machine a second worker competes with it. Measured on SmolLM2-135M decode (1 row, ms/step):
// every call >= 64k MACs split 45, none split (1 thread) 29-40; >= 4M (only the lm_head) 40
// and 33, >= 512k (also gate/up/down, 884k) 33 and 32. Split calls gain ~1.5-2x in isolation
// (lm_head 1.3 vs ~2.6 ms).
// MLXCEL_NATIVE_THREAD_MIN_MACS overrides it.
long thread_min_work() {
  static const long value = [] {
    const char* env = std::getenv("MLXCEL_NATIVE_THREAD_MIN_MACS");
    const long v = env ? std::atol(env) : -1;
    return v >= 0 ? v : 1L << 19;
  }();
  return value;
}

// Splits columns [0, N) into tasks cut at multiples of the kernel's tile width, a few per
// thread so that a core slowed by other work does not hold up the call.
template <class Kernel>
void run_columns(int M, int N, int K, int tile, Kernel kernel) {
  Pool& pool = Pool::instance();
  const long tiles = (long(N) + tile - 1) / tile;
  long tasks = long(M) * N * K < thread_min_work() ? 1 : long(pool.threads()) * 4;
  if (tasks > tiles) tasks = tiles;
  if (tasks <= 1) return kernel(0, N);
  pool.run(int(tasks), [&](int t) {
    const long t0 = tiles * t / tasks;
    const long t1 = tiles * (t + 1) / tasks;
    const long n1 = t1 * tile < N ? t1 * tile : N;
    if (t0 * tile < n1) kernel(int(t0 * tile), int(n1));
  });
}

// x's rows quantised to int8 for the VNNI kernels (Int8Rows, kernels.h) into buffers reused
// across calls on mlx's stream thread (the pool's tasks only read them). `cols_bits`: for the
// columns kernel at that many bits a weight (its own order, xc), 0 for the rows kernel.
Int8Rows int8_rows(const float* x, int M, int K, int group_size, bool nibbles, int cols_bits) {
  const int Mp = (M + 15) / 16 * 16;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> d, sums;
  xq.resize(size_t(Mp) * K);
  d.resize(size_t(Mp) * (K / 32));
  sums.resize(size_t(Mp) * (K / group_size));
  Int8Rows xr{xq.data(), d.data(), sums.data(), Mp, nibbles};
  if (cols_bits != 0) {
    xr.xc = xq.data();
    xr.cols_bits = cols_bits;
  }
  qmm_quantize_rows_int8(x, M, K, group_size, xr);
  return xr;
}

// What both primitives do on the CPU: nothing for empty shapes, zeros for K=0, the portable
// kernel without AVX2 or AVX-512, the rows kernel from kRowsKernelMin rows on (x transposed
// once; `nibble_order` for 4-bit; `cols`: the kernels' tile width at M rows), else
// `tiles(args)` (the register tiles, with any preparation).
template <class Args, class Generic, class Rows, class Tiles>
void run_matmul(const Args& args, bool avx, bool nibble_order, int (*cols)(int), Generic generic,
                Rows rows, Tiles tiles) {
  if (args.M == 0 || args.N == 0) return;
  if (args.K == 0) {
    std::fill(args.out, args.out + long(args.M) * args.N, 0.0f);
    return;
  }
  if (!avx) {
    return run_columns(args.M, args.N, args.K, 1, [&](int n0, int n1) { generic(args, n0, n1); });
  }
  if (args.M >= kRowsKernelMin) {
    const int Mp = (args.M + 15) / 16 * 16;
    std::vector<float> xT(size_t(Mp) * args.K);
    qmm_transpose_x(args.x, xT.data(), args.M, Mp, args.K, nibble_order);
    return run_columns(args.M, args.N, args.K, cols(args.M), [&](int n0, int n1) {
      rows(args, xT.data(), Mp, n0, n1);
    });
  }
  tiles(args);
}

ScaleType scale_type(mx::Dtype t) {
  if (t == mx::float32) return ScaleType::f32;
  if (t == mx::float16) return ScaleType::f16;
  if (t == mx::bfloat16) return ScaleType::bf16;
  throw std::invalid_argument("scales and biases must be float32, float16 or bfloat16");
}

mx::Shape out_shape(const mx::array& x, int N) {
  mx::Shape shape = x.shape();
  shape.back() = N;
  return shape;
}

[[noreturn]] void bad(const std::string& msg) {
  throw std::invalid_argument(msg);
}

// Weights are evaluated, row-major arrays: no Contiguous node for them (one per input and
// matmul was ~40% of a decode step's graph nodes). Anything else gets one.
mx::array as_stored(const mx::array& a, mx::Stream stream) {
  if (a.is_available() && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, stream);
}

}  // namespace

Isa active_isa() {
  if (generic_forced.load(std::memory_order_relaxed)) return Isa::generic;
  const int cap = isa_cap.load(std::memory_order_relaxed);
  return Isa(int(cpu_isa()) < cap ? int(cpu_isa()) : cap);
}

const char* kernel_isa() {
  return kIsaNames[int(active_isa())];
}

const char* set_isa_cap(const std::string& isa) {
  const int cap = isa_from_name(isa);
  if (cap < 0) bad("isa must be avx512, avx2 or generic");
  isa_cap.store(cap);
  return kernel_isa();
}

void force_generic(bool on) {
  generic_forced.store(on);
}

int pool_threads() {
  return Pool::instance().threads();
}

int set_int8_activations(int mode) {
  if (mode < int(Int8Mode::off) || mode > int(Int8Mode::every_row))
    bad("int8 mode must be 0 (off), 1 (many rows) or 2 (every row)");
  int8_wanted.store(mode);
  return int8_mode();
}

int int8_activations() {
  return int8_mode();
}

// A node's own mode (quantized_matmul's `int8`), where the CPU can run int8 at all.
int node_int8_mode(int wanted) {
  if (wanted < -1 || wanted > int(Int8Mode::every_row))
    bad("int8 must be -1 (the process's mode), 0 (off), 1 (many rows) or 2 (every row)");
  if (wanted < 0) return int8_mode();
  if (active_isa() != Isa::avx512 || !cpu_has_vnni()) return int(Int8Mode::off);
  return wanted;
}

mx::array quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    int int8,
    mx::StreamOrDevice s) {
  if (bits != 4 && bits != 8) bad("bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128)
    bad("group_size must be 32, 64 or 128");
  if (x.dtype() != mx::float32) bad("x must be float32");
  if (x.ndim() < 1) bad("x must have at least one dimension");
  if (w.dtype() != mx::uint32 || w.ndim() != 2) bad("w must be a uint32 matrix [N, K*bits/32]");
  const int K = x.shape(-1);
  const int N = w.shape(0);
  if (long(w.shape(1)) * 32 / bits != K) {
    std::ostringstream msg;
    msg << "w holds " << long(w.shape(1)) * 32 / bits << " inputs per row at " << bits
        << " bits, x has " << K;
    bad(msg.str());
  }
  if (scales.ndim() != 2 || scales.shape(0) != N || long(scales.shape(1)) * group_size != K)
    bad("scales must be [N, K / group_size]");
  if (biases.shape() != scales.shape() || biases.dtype() != scales.dtype())
    bad("biases must match scales in shape and dtype");
  scale_type(scales.dtype());
  auto stream = mx::to_stream(s);
  // The kernels read plain row-major buffers: x is made so at evaluation (dense_rows).
  return mx::array(
      out_shape(x, N),
      mx::float32,
      std::make_shared<QuantizedMatmul>(stream, group_size, bits, node_int8_mode(int8)),
      {x, as_stored(w, stream), as_stored(scales, stream), as_stored(biases, stream)});
}

mx::array bf16_matmul(const mx::array& x, const mx::array& w, mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32) bad("x must be float32");
  if (x.ndim() < 1) bad("x must have at least one dimension");
  if (w.dtype() != mx::bfloat16 || w.ndim() != 2) bad("w must be a bfloat16 matrix [N, K]");
  if (w.shape(1) != x.shape(-1)) bad("w must be [N, K] for x [..., K]");
  auto stream = mx::to_stream(s);
  return mx::array(
      out_shape(x, w.shape(0)),
      mx::float32,
      std::make_shared<Bf16Matmul>(stream),
      {x, as_stored(w, stream)});
}

mx::array kquant_matmul(const mx::array& x, const mx::array& w, const std::string& format,
                        int int8, mx::StreamOrDevice s) {
  KQuant kind;
  if (format == "q4_k") {
    kind = KQuant::q4_k;
  } else if (format == "q6_k") {
    kind = KQuant::q6_k;
  } else {
    bad("format must be \"q4_k\" or \"q6_k\", not \"" + format + "\"");
  }
  if (x.dtype() != mx::float32) bad("x must be float32");
  if (x.ndim() < 1) bad("x must have at least one dimension");
  const int K = x.shape(-1);
  if (K % 256 != 0) bad("x must have a multiple of 256 inputs (K-quant blocks)");
  const long row_bytes = long(K) / 256 * kquant_block_bytes(kind);
  if (w.dtype() != mx::uint8 || w.ndim() != 2 || long(w.shape(1)) != row_bytes) {
    std::ostringstream msg;
    msg << "w must be uint8 [N, " << row_bytes << "] (" << format << " blocks of " << K
        << " inputs)";
    bad(msg.str());
  }
  auto stream = mx::to_stream(s);
  return mx::array(
      out_shape(x, w.shape(0)),
      mx::float32,
      std::make_shared<KQuantMatmul>(stream, int(kind), node_int8_mode(int8)),
      {x, as_stored(w, stream)});
}

void QuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  const auto& scales = inputs[2];
  const auto& biases = inputs[3];
  auto& encoder = begin_eval(inputs, out, stream());
  const int K = x.shape(-1);
  QmmArgs args{
      dense_rows(x, stream()),
      w.data<uint32_t>(),
      scales.data<void>(),
      biases.data<void>(),
      scale_type(scales.dtype()),
      group_size_,
      bits_,
      K == 0 ? 0 : int(x.size() / K),
      int(w.shape(0)),
      K,
      out.data<float>()};
  // `many rows` keeps the float tiles below kRowsKernelMin rows (see INT8_MODES in Python).
  const bool int8 = args.K % 32 == 0 &&
      (int8_ == int(Int8Mode::every_row) ||
       (int8_ == int(Int8Mode::many_rows) && args.M >= kRowsKernelMin));
  if (int8) {
    encoder.dispatch([args]() {
      if (args.N == 0 || args.M == 0) return;
      const Int8Rows xr = int8_rows(args.x, args.M, args.K, args.group_size,
                                    args.bits == 4 && args.M >= kRowsKernelMin,
                                    args.M < kRowsKernelMin ? args.bits : 0);
      if (args.M >= kRowsKernelMin) {
        run_columns(args.M, args.N, args.K, kVnniCols, [&](int n0, int n1) {
          qmm_rows_vnni(args, xr, n0, n1);
        });
      } else {
        run_columns(args.M, args.N, args.K, kVnniColsSmall, [&](int n0, int n1) {
          qmm_cols_vnni(args, xr, n0, n1);
        });
      }
    });
    return;
  }
  const Isa isa = active_isa();
  const auto prepared = [](QmmArgs a, int (*cols)(int), void (*tile)(const QmmArgs&, int, int)) {
    std::vector<float> xp;
    if (a.bits == 4) {
      xp.resize(size_t(a.M) * a.K);
      qmm_prepare_x(a.x, xp.data(), a.M, a.K);
      a.x = xp.data();
    }
    run_columns(a.M, a.N, a.K, cols(a.M), [&](int n0, int n1) { tile(a, n0, n1); });
  };
  if (isa == Isa::avx2) {
    encoder.dispatch([args, prepared]() {
      run_matmul(args, true, args.bits == 4, avx2_tile_cols, qmm_generic, qmm_rows_avx2,
                 [&](const QmmArgs& a) { prepared(a, avx2_tile_cols, qmm_avx2); });
    });
    return;
  }
  encoder.dispatch([args, prepared, avx = isa == Isa::avx512]() {
    run_matmul(args, avx, args.bits == 4, avx512_tile_cols, qmm_generic, qmm_rows_avx512,
               [&](const QmmArgs& a) { prepared(a, avx512_tile_cols, qmm_avx512); });
  });
}

void QuantizedMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mlxcel native quantized_matmul runs on the CPU device only");
}

bool QuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto* o = dynamic_cast<const QuantizedMatmul*>(&other);
  return o != nullptr && o->group_size_ == group_size_ && o->bits_ == bits_ && o->int8_ == int8_;
}

void Bf16Matmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  auto& encoder = begin_eval(inputs, out, stream());
  const int K = x.shape(-1);
  Bf16Args args{
      dense_rows(x, stream()),
      reinterpret_cast<const uint16_t*>(w.data<void>()),
      K == 0 ? 0 : int(x.size() / K),
      int(w.shape(0)),
      K,
      out.data<float>()};
  const Isa isa = active_isa();
  const auto tiled = [](const Bf16Args& a, int (*cols)(int),
                        void (*tile)(const Bf16Args&, int, int)) {
    run_columns(a.M, a.N, a.K, cols(a.M), [&](int n0, int n1) { tile(a, n0, n1); });
  };
  if (isa == Isa::avx2) {
    encoder.dispatch([args, tiled]() {
      run_matmul(args, true, false, avx2_tile_cols, bf16mm_generic, bf16mm_rows_avx2,
                 [&](const Bf16Args& a) { tiled(a, avx2_tile_cols, bf16mm_avx2); });
    });
    return;
  }
  encoder.dispatch([args, tiled, avx = isa == Isa::avx512]() {
    run_matmul(args, avx, false, avx512_tile_cols, bf16mm_generic, bf16mm_rows_avx512,
               [&](const Bf16Args& a) { tiled(a, avx512_tile_cols, bf16mm_avx512); });
  });
}

void KQuantMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  auto& encoder = begin_eval(inputs, out, stream());
  const int K = x.shape(-1);
  KQuantArgs args{
      dense_rows(x, stream()),
      w.data<uint8_t>(),
      K == 0 ? 0 : int(x.size() / K),
      int(w.shape(0)),
      K,
      out.data<float>(),
      KQuant(format_)};
  // Int8 activations as for QuantizedMatmul, and at every row count in `every row` mode:
  // the rows kernel then serves any count (lanes of 16 rows), so a row's bits never depend on
  // the rows beside it (--batch-invariant), at the cost of 16 lanes' work for a few rows.
  if (int8_ == int(Int8Mode::every_row) ||
      (int8_ == int(Int8Mode::many_rows) && args.M >= kRowsKernelMin)) {
    encoder.dispatch([args]() {
      if (args.N == 0 || args.M == 0) return;
      const Int8Rows xr = int8_rows(args.x, args.M, args.K, 32, false, 0);
      run_columns(args.M, args.N, args.K, kVnniCols, [&](int n0, int n1) {
        kq_rows_vnni(args, xr, n0, n1);
      });
    });
    return;
  }
  const auto tiled = [](const KQuantArgs& a, int (*cols)(int),
                        void (*tile)(const KQuantArgs&, int, int)) {
    run_columns(a.M, a.N, a.K, cols(a.M), [&](int n0, int n1) { tile(a, n0, n1); });
  };
  const Isa isa = active_isa();
  if (isa == Isa::avx2) {
    encoder.dispatch([args, tiled]() {
      run_matmul(args, true, false, avx2_tile_cols, kq_generic, kq_rows_avx2,
                 [&](const KQuantArgs& a) { tiled(a, avx2_tile_cols, kq_avx2); });
    });
    return;
  }
  encoder.dispatch([args, tiled, avx = isa == Isa::avx512]() {
    run_matmul(args, avx, false, avx512_tile_cols, kq_generic, kq_rows_avx512,
               [&](const KQuantArgs& a) { tiled(a, avx512_tile_cols, kq_avx512); });
  });
}

void KQuantMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mlxcel native kquant_matmul runs on the CPU device only");
}

void Bf16Matmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mlxcel native bf16_matmul runs on the CPU device only");
}

}  // namespace mlxcel_native
