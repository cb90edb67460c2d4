// CUDA kernels of the DSpark ops (semantics and validation: dspark_ops.cpp).
// One block per token: it finds the token's request (qo_indptr, or t / tokens_per_seq), checks in
// parallel that the slot's page is one of that request's block-table entries, and then copies the
// token's H x D values into the page (cast to the cache dtype); a refused write adds 1 to the
// caller's counter (atomicAdd; the op never zeroes it, so it launches this one kernel only).
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include "dspark_ops.h"

namespace trtllm_dspark {
namespace {

constexpr int kThreads = 128;

template <typename V, typename C>
__global__ void paged_kv_append_kernel(const V* __restrict__ values, int64_t value_stride, C* __restrict__ cache,
                                       const int64_t* __restrict__ slots, const int32_t* __restrict__ tables,
                                       const int32_t* __restrict__ qo, int64_t b_n, int64_t width, int64_t q,
                                       int64_t pages, int64_t planes, int64_t heads, int64_t page_size, int64_t dim,
                                       int64_t plane, int32_t* __restrict__ refused) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  __shared__ int owned;
  __shared__ int64_t owner;
  if (threadIdx.x == 0) {
    owned = 0;
    if (qo != nullptr) {  // the last request whose first token is <= t (binary search)
      int64_t lo = 0, hi = b_n - 1;
      while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (qo[mid] <= t) lo = mid; else hi = mid - 1;
      }
      owner = lo;
    } else {
      owner = t / q;
    }
  }
  __syncthreads();
  const int64_t page = slot / page_size, off = slot % page_size;
  for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
    if (tables[owner * width + j] == page) owned = 1;
  }
  __syncthreads();
  if (!owned || page >= pages) {
    if (threadIdx.x == 0) atomicAdd(refused, 1);
    return;
  }
  for (int64_t i = threadIdx.x; i < heads * dim; i += blockDim.x) {
    const int64_t h = i / dim, d = i % dim;
    cache[(((page * planes + plane) * heads + h) * page_size + off) * dim + d] =
        static_cast<C>(static_cast<float>(values[t * value_stride + h * dim + d]));
  }
}

// One block per (row, group): the group's amax by a block reduction, its UE8M0 byte (frexp, as the
// CPU kernel and the torch reference), then every element divided by the power-of-two scale and
// rounded to e4m3 (nearest even, c10's conversion: the reference's).
template <typename T>
__global__ void quantize_ue8m0_kernel(const T* __restrict__ x, int64_t stride, int64_t k_n, int64_t group,
                                      c10::Float8_e4m3fn* __restrict__ q, uint8_t* __restrict__ scale, int64_t kb) {
  const int64_t m = blockIdx.x, g = blockIdx.y;
  const int64_t k0 = g * group, k1 = min(k0 + group, k_n);
  __shared__ float red[kThreads];
  float amax = 0.0f;
  for (int64_t k = k0 + threadIdx.x; k < k1; k += blockDim.x) amax = fmaxf(amax, fabsf(static_cast<float>(x[m * stride + k])));
  red[threadIdx.x] = amax;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + w]);
    __syncthreads();
  }
  const float v = red[0] / 448.0f;
  int byte = 127;
  if (v > 0.0f) {
    int e = 0;
    const float mant = frexpf(v, &e);
    byte = min(max(((mant == 0.5f) ? e - 1 : e) + 127, 0), 254);
  }
  if (threadIdx.x == 0) scale[m * kb + g] = static_cast<uint8_t>(byte);
  const float s = ldexpf(1.0f, byte - 127);
  for (int64_t k = k0 + threadIdx.x; k < k1; k += blockDim.x) {
    q[m * k_n + k] = c10::Float8_e4m3fn(static_cast<float>(x[m * stride + k]) / s);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_ue8m0_cuda(const at::Tensor& x, int64_t group) {
  check_quantize_ue8m0(x, group);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t m_n = x.size(0), k_n = x.size(1), kb = (k_n + group - 1) / group;
  auto q = at::empty({m_n, k_n}, x.options().dtype(at::kFloat8_e4m3fn));
  auto scale = at::empty({m_n, kb}, x.options().dtype(at::kByte));
  if (m_n == 0 || k_n == 0) return {q, scale};
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "dspark_quantize_ue8m0", [&] {
    quantize_ue8m0_kernel<<<dim3(m_n, kb), kThreads, 0, stream>>>(x.data_ptr<scalar_t>(), x.stride(0), k_n, group,
                                                                   q.data_ptr<c10::Float8_e4m3fn>(),
                                                                   scale.data_ptr<uint8_t>(), kb);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, scale};
}

void paged_kv_append_cuda(const at::Tensor& values, at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const std::optional<at::Tensor>& qo_indptr,
                          int64_t tokens_per_seq, int64_t plane, at::Tensor& refused) {
  check_paged_kv_append(values, kv_cache, slot_mapping, block_tables, qo_indptr, tokens_per_seq, plane, refused);
  const c10::cuda::CUDAGuard guard(values.device());
  const int64_t t_n = values.size(0);
  if (t_n == 0) return;
  const int32_t* qo = qo_indptr.has_value() ? qo_indptr->data_ptr<int32_t>() : nullptr;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "dspark_paged_kv_append", [&] {
    using V = scalar_t;
    auto run = [&](auto* cache) {
      paged_kv_append_kernel<<<t_n, kThreads, 0, stream>>>(
          values.data_ptr<V>(), values.stride(0), cache, slot_mapping.data_ptr<int64_t>(),
          block_tables.data_ptr<int32_t>(), qo,
          block_tables.size(0), block_tables.size(1), tokens_per_seq, kv_cache.size(0), kv_cache.size(1),
          kv_cache.size(2), kv_cache.size(3), kv_cache.size(4), plane, refused.data_ptr<int32_t>());
    };
    switch (kv_cache.scalar_type()) {
      case at::kFloat8_e4m3fn: run(kv_cache.data_ptr<c10::Float8_e4m3fn>()); break;
      case at::kFloat8_e5m2: run(kv_cache.data_ptr<c10::Float8_e5m2>()); break;
      default: run(kv_cache.data_ptr<V>());
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace trtllm_dspark

TORCH_LIBRARY_IMPL(trtllm, CUDA, m) {
  m.impl("dspark_paged_kv_append", &trtllm_dspark::paged_kv_append_cuda);
  m.impl("dspark_quantize_ue8m0", &trtllm_dspark::quantize_ue8m0_cuda);
}
