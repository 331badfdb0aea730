// The parts of ATen the kernels use (Tensor, dtypes, empty, parallel_for, TORCH_CHECK), without
// <torch/extension.h>: that header brings pybind11 and torch's whole C++ frontend and costs ~27 s
// of compile time in every source that includes it, against ~3 s for these. Only the bindings
// (bindings.cpp, quant/csrc/*bindings.cpp) include pybind11, through torch's own type casters.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
