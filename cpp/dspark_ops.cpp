// DSpark ops (TORCH_LIBRARY(trtllm)): CPU kernels, input checks and the op schemas.
//
// trtllm::dspark_quantize_ue8m0(x [M, K], group) -> (q [M, K] float8_e4m3fn, scale [M, ceil(K/group)]
// uint8): per-token 1 x group blocks, each scaled by its amax / 448 rounded UP to a power of two
// (the `cvt.rp` semantics; stored as the biased exponent byte, 2^(byte - 127), clamped to [0, 254];
// amax 0 -> byte 127); q = e4m3(x / scale), round to nearest even. The torch reference is
// tensorrt_llm/_torch/modules/fp8_block.py (`quantize_blocks(x, 1, group)`): bit for bit equal.
//
// trtllm::dspark_paged_kv_append: a step's new K, V or MLA latents written into each request's own
// pages, with the per-request page bound enforced in the kernel.
//
//   values       [T, H, D]  bfloat16 / float16 / float32 (token t of the packed step; heads and dims
//                contiguous, any token stride: a view of a fused projection is read in place)
//   kv_cache     [pages, planes, H, P, D]  the values' dtype, or fp8 (e4m3 / e5m2: cast on write)
//   slot_mapping [T] int64  flat slot page * P + offset; -1 = no write (skipped, not refused)
//   block_tables [B, W] int32  request b's pages; BAD_PAGE_INDEX (-1) where unallocated
//   qo_indptr    [B + 1] int32 (ragged steps: request b owns tokens qo_indptr[b]..qo_indptr[b+1]-1),
//                or none with tokens_per_seq > 0 (request b owns tokens b*q..b*q+q-1)
//   plane        which plane of the cache (0: K or latent, 1: V)
//   refused      [1] int32, the caller's counter: each write refused because the slot's page is not
//                one of its request's adds 1 (never zeroed here, so a persistent counter needs no
//                fill per call and a CUDA-graph replay accumulates into it)
//
// A slot whose page is not in its request's block-table row (another request's page, a page past
// the ones it owns, or outside the pool) is refused in the kernel, never written: the page bound
// holds whatever slots the caller computed (on the host or on the device).
#include "dspark_ops.h"

#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>

namespace trtllm_dspark {
namespace {

bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

std::string shape_str(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

void check_on(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, "DSpark ", name, " must be on ", device.str(), " (the values' device), got ",
                    t.device().str());
}

}  // namespace

void check_paged_kv_append(const at::Tensor& values, const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                           const at::Tensor& block_tables, const std::optional<at::Tensor>& qo_indptr,
                           int64_t tokens_per_seq, int64_t plane, const at::Tensor& refused) {
  TORCH_CHECK_VALUE(values.dim() == 3, "DSpark values must be [T, H, D], got ", values.dim(), "-D");
  TORCH_CHECK_VALUE(kv_cache.dim() == 5, "DSpark kv_cache must be [pages, planes, H, P, D], got ", kv_cache.dim(),
                    "-D");
  auto vt = values.scalar_type();
  TORCH_CHECK_VALUE(vt == at::kBFloat16 || vt == at::kHalf || vt == at::kFloat,
                    "DSpark values dtype must be one of (BFloat16, Half, Float), got ", vt);
  auto ct = kv_cache.scalar_type();
  TORCH_CHECK_VALUE(ct == vt || is_fp8(ct), "DSpark kv_cache dtype must be the values' (", vt,
                    ") or one of (Float8_e4m3fn, Float8_e5m2), got ", ct);
  TORCH_CHECK_VALUE(kv_cache.size(0) > 0, "DSpark kv_cache must hold at least one page");
  TORCH_CHECK_VALUE(kv_cache.stride(0) != 0, "DSpark kv_cache page stride must be non-zero, got strides ",
                    kv_cache.strides());
  TORCH_CHECK_VALUE(values.size(1) == kv_cache.size(2), "DSpark num_heads must be the cache's (", kv_cache.size(2),
                    "), got ", values.size(1));
  TORCH_CHECK_VALUE(values.size(2) == kv_cache.size(4), "DSpark head_dim must be the cache's (", kv_cache.size(4),
                    "), got ", values.size(2));
  TORCH_CHECK_VALUE(plane >= 0 && plane < kv_cache.size(1), "DSpark plane must be in [0, ", kv_cache.size(1),
                    "), got ", plane);
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong, "DSpark slot_mapping must be Long, got ",
                    slot_mapping.scalar_type());
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == values.size(0), "DSpark slot_mapping must be [",
                    values.size(0), "], got ", shape_str(slot_mapping));
  TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kInt, "DSpark block_tables must be Int, got ",
                    block_tables.scalar_type());
  TORCH_CHECK_VALUE(block_tables.dim() == 2, "DSpark block_tables must be [B, max_pages], got ", block_tables.dim(),
                    "-D");
  int64_t b = block_tables.size(0);
  if (qo_indptr.has_value()) {
    const at::Tensor& qo = *qo_indptr;
    TORCH_CHECK_VALUE(qo.scalar_type() == at::kInt, "DSpark qo_indptr must be Int, got ", qo.scalar_type());
    TORCH_CHECK_VALUE(qo.dim() == 1 && qo.size(0) == b + 1, "DSpark qo_indptr must be [", b + 1, "], got ",
                      shape_str(qo));
  } else {
    TORCH_CHECK_VALUE(tokens_per_seq > 0 && tokens_per_seq * b == values.size(0),
                      "DSpark tokens_per_seq must split the ", values.size(0), " tokens over ", b,
                      " requests without qo_indptr, got ", tokens_per_seq);
  }
  TORCH_CHECK_VALUE(refused.scalar_type() == at::kInt, "DSpark refused must be Int, got ", refused.scalar_type());
  TORCH_CHECK_VALUE(refused.dim() == 1 && refused.size(0) == 1, "DSpark refused must be [1], got ",
                    shape_str(refused));
  const at::Device device = values.device();
  check_on(kv_cache, "kv_cache", device);
  check_on(slot_mapping, "slot_mapping", device);
  check_on(block_tables, "block_tables", device);
  if (qo_indptr.has_value()) check_on(*qo_indptr, "qo_indptr", device);
  check_on(refused, "refused", device);
  TORCH_CHECK_VALUE(values.stride(2) == 1 && values.stride(1) == values.size(2),
                    "DSpark values must have contiguous heads and dims (strides [*, ", values.size(2), ", 1]), got ",
                    values.strides());
  TORCH_CHECK_VALUE(kv_cache.is_contiguous(), "DSpark kv_cache must be contiguous");
  TORCH_CHECK_VALUE(slot_mapping.is_contiguous(), "DSpark slot_mapping must be contiguous");
  TORCH_CHECK_VALUE(block_tables.is_contiguous(), "DSpark block_tables must be contiguous");
  if (qo_indptr.has_value()) TORCH_CHECK_VALUE(qo_indptr->is_contiguous(), "DSpark qo_indptr must be contiguous");
}

void check_quantize_ue8m0(const at::Tensor& x, int64_t group) {
  TORCH_CHECK_VALUE(x.dim() == 2, "DSpark quantize input must be [M, K], got ", x.dim(), "-D");
  auto t = x.scalar_type();
  TORCH_CHECK_VALUE(t == at::kBFloat16 || t == at::kHalf || t == at::kFloat,
                    "DSpark quantize input dtype must be one of (BFloat16, Half, Float), got ", t);
  TORCH_CHECK_VALUE(group >= 1 && group <= 1024, "DSpark quantize group must be in [1, 1024], got ", group);
  TORCH_CHECK_VALUE(x.size(1) == 0 || x.stride(1) == 1,
                    "DSpark quantize input must have a contiguous last dimension, got strides ", x.strides());
}

namespace {

// The UE8M0 byte of a block with this amax: ceil(log2(amax / 448)) + 127 from frexp, clamped.
inline int ue8m0_byte(float amax) {
  float v = amax / 448.0f;
  if (!(v > 0.0f)) return 127;
  int e = 0;
  float m = std::frexp(v, &e);
  int exp = (m == 0.5f) ? e - 1 : e;
  return std::min(std::max(exp + 127, 0), 254);
}

template <typename T>
void quantize_cpu(const T* x, int64_t stride, int64_t m_n, int64_t k_n, int64_t group, c10::Float8_e4m3fn* q,
                  uint8_t* scale, int64_t kb) {
  for (int64_t m = 0; m < m_n; ++m) {
    for (int64_t g = 0; g < kb; ++g) {
      int64_t k0 = g * group, k1 = std::min(k0 + group, k_n);
      float amax = 0.0f;
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(static_cast<float>(x[m * stride + k])));
      int byte = ue8m0_byte(amax);
      scale[m * kb + g] = static_cast<uint8_t>(byte);
      float s = std::ldexp(1.0f, byte - 127);
      for (int64_t k = k0; k < k1; ++k) q[m * k_n + k] = c10::Float8_e4m3fn(static_cast<float>(x[m * stride + k]) / s);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> quantize_ue8m0_cpu(const at::Tensor& x, int64_t group) {
  check_quantize_ue8m0(x, group);
  int64_t m_n = x.size(0), k_n = x.size(1), kb = (k_n + group - 1) / group;
  auto q = at::empty({m_n, k_n}, x.options().dtype(at::kFloat8_e4m3fn));
  auto scale = at::empty({m_n, kb}, x.options().dtype(at::kByte));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "dspark_quantize_ue8m0", [&] {
    quantize_cpu(x.data_ptr<scalar_t>(), x.stride(0), m_n, k_n, group, q.data_ptr<c10::Float8_e4m3fn>(),
                 scale.data_ptr<uint8_t>(), kb);
  });
  return {q, scale};
}

template <typename V, typename C>
void append_cpu(const V* values, int64_t value_stride, C* cache, const int64_t* slots, const int32_t* tables,
                const int32_t* qo, int64_t t_n, int64_t b_n, int64_t width, int64_t q, int64_t pages, int64_t planes,
                int64_t heads, int64_t page_size, int64_t dim, int64_t plane, int32_t* refused) {
  for (int64_t t = 0; t < t_n; ++t) {
    int64_t slot = slots[t];
    if (slot < 0) continue;
    int64_t b = 0;
    if (qo != nullptr) {
      while (b + 1 < b_n && qo[b + 1] <= t) ++b;
    } else {
      b = t / q;
    }
    int64_t page = slot / page_size, off = slot % page_size;
    bool owned = false;
    for (int64_t j = 0; j < width && !owned; ++j) owned = tables[b * width + j] == page;
    if (!owned || page >= pages) {
      ++*refused;
      continue;
    }
    for (int64_t h = 0; h < heads; ++h) {
      C* dst = cache + (((page * planes + plane) * heads + h) * page_size + off) * dim;
      const V* src = values + t * value_stride + h * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<C>(static_cast<float>(src[d]));
    }
  }
}

void paged_kv_append_cpu(const at::Tensor& values, at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const std::optional<at::Tensor>& qo_indptr,
                         int64_t tokens_per_seq, int64_t plane, at::Tensor& refused) {
  check_paged_kv_append(values, kv_cache, slot_mapping, block_tables, qo_indptr, tokens_per_seq, plane, refused);
  const int32_t* qo = qo_indptr.has_value() ? qo_indptr->data_ptr<int32_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "dspark_paged_kv_append", [&] {
    using V = scalar_t;
    auto run = [&](auto* cache) {
      append_cpu(values.data_ptr<V>(), values.stride(0), cache, slot_mapping.data_ptr<int64_t>(),
                 block_tables.data_ptr<int32_t>(), qo,
                 values.size(0), block_tables.size(0), block_tables.size(1), tokens_per_seq, kv_cache.size(0),
                 kv_cache.size(1), kv_cache.size(2), kv_cache.size(3), kv_cache.size(4), plane,
                 refused.data_ptr<int32_t>());
    };
    switch (kv_cache.scalar_type()) {
      case at::kFloat8_e4m3fn: run(kv_cache.data_ptr<c10::Float8_e4m3fn>()); break;
      case at::kFloat8_e5m2: run(kv_cache.data_ptr<c10::Float8_e5m2>()); break;
      default: run(kv_cache.data_ptr<V>());
    }
  });
}

}  // namespace
}  // namespace trtllm_dspark

TORCH_LIBRARY(trtllm, m) {
  m.def(
      "dspark_paged_kv_append(Tensor values, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor block_tables, "
      "Tensor? qo_indptr, int tokens_per_seq, int plane, Tensor(b!) refused) -> ()");
  m.def("dspark_quantize_ue8m0(Tensor x, int group) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(trtllm, CPU, m) {
  m.impl("dspark_paged_kv_append", &trtllm_dspark::paged_kv_append_cpu);
  m.impl("dspark_quantize_ue8m0", &trtllm_dspark::quantize_ue8m0_cpu);
}
