#include "row_ops.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "kernels.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops.h"
#include "pool.h"

namespace mlxcel_native {
namespace {

[[noreturn]] void bad(const std::string& msg) {
  throw std::invalid_argument(msg);
}

// Where each row (all but the last axis) of an array with any strides starts, in elements from
// its data pointer, and the last axis's stride: what the kernels need to read it in place
// (a transposed view, as attention's [B, L, H, D] -> [B, H, L, D], costs no copy).
struct Rows {
  std::vector<int64_t> starts;
  int64_t step = 1;
};

Rows rows_of(const mx::array& a) {
  Rows r;
  const int nd = a.ndim();
  r.step = nd ? a.strides()[nd - 1] : 1;
  int64_t n = 1;
  for (int i = 0; i + 1 < nd; ++i) n *= a.shape(i);
  r.starts.resize(n);
  std::vector<int> idx(nd > 0 ? nd - 1 : 0, 0);
  for (int64_t k = 0; k < n; ++k) {
    int64_t off = 0;
    for (int i = 0; i + 1 < nd; ++i) off += int64_t(idx[i]) * a.strides()[i];
    r.starts[k] = off;
    for (int i = nd - 2; i >= 0; --i) {
      if (++idx[i] < a.shape(i)) break;
      idx[i] = 0;
    }
  }
  return r;
}

void rms_rows(const float* x, const Rows& rows, const float* w, int64_t wstep, int D, float eps,
              float* out) {
  constexpr int kLanes = 16;  // partial sums: lets the compiler vectorise the reduction
  for (size_t r = 0; r < rows.starts.size(); ++r) {
    const float* xr = x + rows.starts[r];
    float part[kLanes] = {};
    int i = 0;
    if (rows.step == 1) {
      for (; i + kLanes <= D; i += kLanes)
        for (int j = 0; j < kLanes; ++j) part[j] += xr[i + j] * xr[i + j];
    }
    for (; i < D; ++i) part[i % kLanes] += xr[i * rows.step] * xr[i * rows.step];
    float sum = 0.0f;
    for (int j = 0; j < kLanes; ++j) sum += part[j];
    // As the fallback: mean, + eps, rsqrt (1 / sqrt), then (x * r) * w.
    const float inv = 1.0f / std::sqrt(sum / float(D) + eps);
    float* o = out + int64_t(r) * D;
    for (int k = 0; k < D; ++k) o[k] = (xr[k * rows.step] * inv) * w[k * wstep];
  }
}

}  // namespace

mx::cpu::CommandEncoder& begin_eval(const std::vector<mx::array>& inputs, mx::array& out,
                                    mx::Stream stream) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  return encoder;
}

const float* dense_rows(const mx::array& x, mx::Stream stream) {
  if (x.flags().row_contiguous) return x.data<float>();
  mx::array copy(x.shape(), mx::float32, nullptr, {});
  copy.set_data(mx::allocator::malloc(copy.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.dispatch([xp = x.data<float>(), rows = rows_of(x), D = int64_t(x.shape(-1)),
                    out = copy.data<float>()]() {
    for (size_t r = 0; r < rows.starts.size(); ++r)
      for (int64_t k = 0; k < D; ++k) out[int64_t(r) * D + k] = xp[rows.starts[r] + k * rows.step];
  });
  const float* data = copy.data<float>();
  encoder.add_temporary(std::move(copy));
  return data;
}

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps, mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32) bad("rms_norm: x and w must be float32");
  if (x.ndim() < 1) bad("rms_norm: x must have at least one dimension");
  if (w.ndim() != 1 || w.shape(0) != x.shape(-1)) bad("rms_norm: w must be [D] for x [..., D]");
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(mx::to_stream(s), eps),
                   {x, w});
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  auto& encoder = begin_eval(inputs, out, stream());
  if (out.size() == 0) return;
  encoder.dispatch([xp = x.data<float>(), rows = rows_of(x), wp = w.data<float>(),
                    wstep = int64_t(w.strides()[0]), D = int(x.shape(-1)), eps = eps_,
                    op = out.data<float>()]() { rms_rows(xp, rows, wp, wstep, D, eps, op); });
}

void RmsNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mlxcel native rms_norm runs on the CPU device only");
}

bool RmsNorm::is_equivalent(const mx::Primitive& other) const {
  const auto* o = dynamic_cast<const RmsNorm*>(&other);
  return o != nullptr && o->eps_ == eps_;
}

mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    float base,
    float scale,
    const mx::array& offset,
    const std::optional<mx::array>& freqs,
    mx::StreamOrDevice s) {
  if (x.dtype() != mx::float32) bad("rope: x must be float32");
  if (x.ndim() < 3) bad("rope: x must have at least 3 dimensions");
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(-1))
    bad("rope: dims must be even, positive and at most the last dimension");
  if (offset.dtype() != mx::int32 || offset.ndim() > 1 ||
      (offset.size() != 1 && int(offset.size()) != x.shape(0)))
    bad("rope: offset must be int32, a scalar or one per batch entry");
  std::vector<mx::array> inputs = {x, offset};
  if (freqs) {
    if (freqs->dtype() != mx::float32 || freqs->ndim() != 1 || freqs->shape(0) != dims / 2)
      bad("rope: freqs must be float32 [dims / 2]");
    inputs.push_back(*freqs);
  }
  return mx::array(
      x.shape(), mx::float32,
      std::make_shared<Rope>(mx::to_stream(s), dims, traditional, base, scale),
      std::move(inputs));
}

void Rope::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const auto& x = inputs[0];
  const auto& offset = inputs[1];
  auto& encoder = begin_eval(inputs, out, stream());
  if (out.size() == 0) return;
  // The offset and freqs are read when the task runs: their producers may still be queued
  // on the stream when this is encoded.
  const float* fp = nullptr;
  int64_t fstep = 0;
  if (inputs.size() == 3) {
    fp = inputs[2].data<float>();
    fstep = inputs[2].strides()[0];
  }
  encoder.dispatch([xp = x.data<float>(), rows = rows_of(x), B = int64_t(x.shape(0)),
                    L = int64_t(x.shape(-2)), D = int(x.shape(-1)), half = dims_ / 2,
                    op_ = offset.data<int32_t>(), n_off = int64_t(offset.size()),
                    off_step = int64_t(offset.ndim() ? offset.strides()[0] : 0), fp, fstep,
                    base = base_, scale = scale_, trad = traditional_, op = out.data<float>()]() {
    // Inverse frequencies as the fallback makes them: exp(-i * (log(base) / half)) in
    // float32, or 1 / freqs.
    std::vector<float> inv(half);
    if (fp != nullptr) {
      for (int i = 0; i < half; ++i) inv[i] = 1.0f / fp[i * fstep];
    } else {
      const float step = std::log(base) / float(half);
      for (int i = 0; i < half; ++i) inv[i] = std::exp(float(-i) * step);
    }
    const int64_t n = int64_t(rows.starts.size());
    const int64_t per_batch = n / B;  // rows per batch entry: heads (and more) x L
    std::vector<float> cs(half), sn(half);
    int64_t cached = -1;  // the (batch offset + position) the table holds
    for (int64_t r = 0; r < n; ++r) {
      const int64_t b = r / per_batch;
      const int64_t l = r % L;
      const int64_t p = int64_t(op_[(n_off == 1 ? 0 : b) * off_step]) + l;
      if (p != cached) {
        const float pos = float(p) * scale;
        for (int i = 0; i < half; ++i) {
          const float theta = pos * inv[i];
          cs[i] = std::cos(theta);
          sn[i] = std::sin(theta);
        }
        cached = p;
      }
      const float* xr = xp + rows.starts[r];
      const int64_t st = rows.step;
      float* o = op + r * D;
      for (int i = 0; i < half; ++i) {
        const int i1 = trad ? 2 * i : i;
        const int i2 = trad ? 2 * i + 1 : i + half;
        const float x1 = xr[i1 * st];
        const float x2 = xr[i2 * st];
        o[i1] = x1 * cs[i] - x2 * sn[i];
        o[i2] = x1 * sn[i] + x2 * cs[i];
      }
      for (int k = 2 * half; k < D; ++k) o[k] = xr[k * st];
    }
  });
}

void Rope::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mlxcel native rope runs on the CPU device only");
}

bool Rope::is_equivalent(const mx::Primitive& other) const {
  const auto* o = dynamic_cast<const Rope*>(&other);
  return o != nullptr && o->dims_ == dims_ && o->traditional_ == traditional_ &&
      o->base_ == base_ && o->scale_ == scale_;
}

bool attention_blocked(const AttnArgs& a) {
  // From 8 query rows per KV head on, transposing its keys once pays for itself.
  return int64_t(a.H / a.KVH) * a.Lq >= 8;
}

bool attention_grouped(const AttnArgs& a) {
  // Below attention_blocked's threshold attend_rows would read every key once per query
  // head; with a mask that differs between heads, the heads keep different keys.
  const bool mask_per_head = (a.keep != nullptr || a.add != nullptr) && a.m_sh != 0;
  return a.H / a.KVH > 1 && !attention_blocked(a) && !mask_per_head;
}

mx::array attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    bool causal,
    const std::optional<mx::array>& mask,
    mx::StreamOrDevice s) {
  const Isa isa = active_isa();
  if (isa == Isa::generic) bad("attention needs AVX2 or AVX-512");
  if (q.dtype() != mx::float32 || k.dtype() != mx::float32 || v.dtype() != mx::float32)
    bad("attention: q, k and v must be float32");
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) bad("attention: 4-d q, k, v");
  if (k.shape(0) != q.shape(0) || v.shape(0) != q.shape(0) || k.shape(1) != v.shape(1) ||
      k.shape(2) != v.shape(2) || k.shape(3) != q.shape(3) || k.shape(1) == 0 ||
      q.shape(1) % k.shape(1) != 0)
    bad("attention: q [B, H, Lq, D], k [B, KVH, S, D], v [B, KVH, S, Dv], KVH | H");
  if (causal && q.shape(2) > k.shape(2)) bad("attention: causal with more queries than keys");
  std::vector<mx::array> inputs = {q, k, v};
  if (mask) {
    if (mask->dtype() != mx::bool_ && mask->dtype() != mx::float32)
      bad("attention: the mask must be bool or float32");
    if (mask->ndim() > 4) bad("attention: the mask has more than 4 dimensions");
    const int off = 4 - mask->ndim();
    const int want[4] = {q.shape(0), q.shape(1), q.shape(2), k.shape(2)};
    for (int i = 0; i < mask->ndim(); ++i)
      if (mask->shape(i) != 1 && mask->shape(i) != want[i + off])
        bad("attention: the mask does not broadcast to [B, H, Lq, S]");
    inputs.push_back(*mask);
  }
  mx::Shape shape = q.shape();
  shape.back() = v.shape(3);
  return mx::array(shape, mx::float32,
                   std::make_shared<Attention>(mx::to_stream(s), scale, causal, isa),
                   std::move(inputs));
}

void Attention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = begin_eval(inputs, out, stream());
  if (out.size() == 0) return;
  // Each input's last axis must be contiguous; anything else is copied first.
  auto last_dense = [&](const mx::array& a) -> std::pair<const float*, std::vector<int64_t>> {
    std::vector<int64_t> st(a.strides().begin(), a.strides().end());
    if (a.strides().back() == 1 || a.shape(-1) == 1) return {a.data<float>(), st};
    int64_t acc = 1;
    for (int i = a.ndim() - 1; i >= 0; --i) {
      st[i] = acc;
      acc *= a.shape(i);
    }
    return {dense_rows(a, stream()), st};
  };
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  auto [qp, qs] = last_dense(q);
  auto [kp, ks] = last_dense(k);
  auto [vp, vs] = last_dense(v);
  AttnArgs a{};
  a.q = qp;
  a.q_sb = qs[0];
  a.q_sh = qs[1];
  a.q_sl = qs[2];
  a.k = kp;
  a.k_sb = ks[0];
  a.k_sh = ks[1];
  a.k_ss = ks[2];
  a.v = vp;
  a.v_sb = vs[0];
  a.v_sh = vs[1];
  a.v_ss = vs[2];
  if (inputs.size() == 4) {
    const auto& m = inputs[3];
    // Broadcast strides over [B, H, Lq, S]: a dimension of 1 (or missing) reads index 0.
    int64_t st[4] = {0, 0, 0, 0};
    const int off = 4 - m.ndim();
    for (int i = 0; i < m.ndim(); ++i) st[i + off] = m.shape(i) == 1 ? 0 : m.strides()[i];
    a.m_sb = st[0];
    a.m_sh = st[1];
    a.m_sl = st[2];
    a.m_ss = st[3];
    if (m.dtype() == mx::bool_) {
      a.keep = m.data<uint8_t>();
    } else {
      a.add = m.data<float>();
    }
  }
  a.B = q.shape(0);
  a.H = q.shape(1);
  a.Lq = q.shape(2);
  a.KVH = k.shape(1);
  a.S = k.shape(2);
  a.D = k.shape(3);
  a.Dv = v.shape(3);
  a.causal = causal_;
  a.scale = scale_;
  a.out = out.data<float>();
  a.grouped = attention_grouped(a);
  encoder.dispatch([a, kernel = isa_ == Isa::avx512 ? attention_avx512 : attention_avx2]() {
    // Grouped, the kernels count units of H / KVH rows (AttnArgs::grouped).
    const int64_t rows = int64_t(a.B) * (a.grouped ? a.KVH : a.H) * a.Lq;
    // Split over the pool when the multiply-adds are many (long contexts, prompts, batches).
    const int64_t work = int64_t(a.B) * a.H * a.Lq * a.S * (a.D + a.Dv);
    Pool& pool = Pool::instance();
    const int64_t tasks = work < (1L << 18) ? 1 : std::min<int64_t>(rows, pool.threads() * 8);
    if (tasks <= 1) return kernel(a, 0, rows);
    pool.run(int(tasks), [&](int t) {
      kernel(a, rows * t / tasks, rows * (t + 1) / tasks);
    });
  });
}

void Attention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mlxcel native attention runs on the CPU device only");
}

bool Attention::is_equivalent(const mx::Primitive& other) const {
  const auto* o = dynamic_cast<const Attention*>(&other);
  return o != nullptr && o->scale_ == scale_ && o->causal_ == causal_ && o->isa_ == isa_;
}

mx::array silu_mul(const mx::array& gate, const mx::array& x, mx::StreamOrDevice s) {
  const Isa isa = active_isa();
  if (isa == Isa::generic) bad("silu_mul needs AVX2 or AVX-512");
  if (gate.dtype() != mx::float32 || x.dtype() != mx::float32 || gate.shape() != x.shape())
    bad("silu_mul: gate and x must be float32 arrays of one shape");
  return mx::array(gate.shape(), mx::float32, std::make_shared<SiluMul>(mx::to_stream(s), isa),
                   {gate, x});
}

void SiluMul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = begin_eval(inputs, out, stream());
  if (out.size() == 0) return;
  encoder.dispatch([g = dense_rows(inputs[0], stream()), x = dense_rows(inputs[1], stream()),
                    o = out.data<float>(), n = int64_t(out.size()),
                    kernel = isa_ == Isa::avx512 ? silu_mul_avx512 : silu_mul_avx2]() {
    Pool& pool = Pool::instance();
    const int64_t tasks = n < (1L << 16) ? 1 : pool.threads() * 2;
    if (tasks <= 1) return kernel(g, x, o, 0, n);
    pool.run(int(tasks), [&](int t) {
      // Cut at multiples of 16 so every task but the last stores whole vectors.
      const int64_t i0 = (n * t / tasks) / 16 * 16, i1 = t + 1 == tasks ? n : (n * (t + 1) / tasks) / 16 * 16;
      kernel(g, x, o, i0, i1);
    });
  });
}

void SiluMul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("mlxcel native silu_mul runs on the CPU device only");
}

}  // namespace mlxcel_native
