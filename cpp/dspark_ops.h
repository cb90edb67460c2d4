// DSpark ops (TORCH_LIBRARY(trtllm)): shared declarations of the CPU and CUDA implementations.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace trtllm_dspark {

// Validates the inputs of trtllm::dspark_paged_kv_append (ValueError with the messages that
// tensorrt_llm/_torch/attention_backend/paged_append.py mirrors).
void check_paged_kv_append(const at::Tensor& values, const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                           const at::Tensor& block_tables, const std::optional<at::Tensor>& qo_indptr,
                           int64_t tokens_per_seq, int64_t plane, const at::Tensor& refused);

void paged_kv_append_cuda(const at::Tensor& values, at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const std::optional<at::Tensor>& qo_indptr,
                          int64_t tokens_per_seq, int64_t plane, at::Tensor& refused);

// Validates the input of trtllm::dspark_quantize_ue8m0 (ValueError; mirrored by
// tensorrt_llm/_torch/modules/fp8_block.py).
void check_quantize_ue8m0(const at::Tensor& x, int64_t group);

std::tuple<at::Tensor, at::Tensor> quantize_ue8m0_cuda(const at::Tensor& x, int64_t group);

}  // namespace trtllm_dspark
