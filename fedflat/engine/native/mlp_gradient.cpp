// fedflat's native MLP gradient: MLPGradient.loss_grad (fedflat/engine/gradients/hand.py) as one C++ operator.
//
// The same ATen operations in the same order on operands of the same layout as the Python method (and so as
// autograd): the forward addmm(b, a, W^T) and relu, _log_softmax, nll_loss_forward, then nll_loss_backward and
// _log_softmax_backward_data for G_L = (softmax(z_L) - onehot(y)) / B, and per layer, last first,
// sum(G, 0, keepdim) into the bias's slice of g, mm(G^T, a) into the weight's slice (through a fresh, 64-byte
// aligned matrix where the slice is not aligned) and G <- threshold_backward(mm(G, W), a, 0). Each call goes
// through the dispatcher to the kernel the Python call reaches, so loss and gradient are the Python method's bit
// for bit (tests/test_native.py).
//
// What it saves: the ~35 Python-level operator calls of a step become one, called through torch.ops, which runs
// the operator with the GIL released; two client threads then train in parallel instead of handing the GIL to
// each other around every small operation (docs/benchmarks.md, "The native MLP gradient").
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_log_softmax.h>
#include <ATen/ops/_log_softmax_backward_data.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/nll_loss_backward.h>
#include <ATen/ops/nll_loss_forward.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/threshold_backward.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kMean = 1;            // at::Reduction::Mean, F.cross_entropy's default
constexpr int64_t kIgnoreIndex = -100;  // F.cross_entropy's default ignore_index
constexpr uintptr_t kAlignment = 64;    // a fresh CPU tensor's alignment (gradients/hand.py's ALIGNMENT)

struct Layer {
  at::Tensor W, Wt, b;  // views of w: [out, in], its transpose, [out]
  int64_t weight, bias, out, in;
};

// slots: per layer (weight offset, bias offset, out, in), the Python Slot's fields in order
std::vector<Layer> layers_of(const at::Tensor& w, at::IntArrayRef slots) {
  TORCH_CHECK(slots.size() % 4 == 0 && !slots.empty(), "fedflat::mlp_loss_grad: slots holds 4 numbers per layer");
  std::vector<Layer> layers;
  for (size_t i = 0; i < slots.size(); i += 4) {
    Layer l{{}, {}, {}, slots[i], slots[i + 1], slots[i + 2], slots[i + 3]};
    l.W = w.narrow(0, l.weight, l.out * l.in).view({l.out, l.in});
    l.Wt = l.W.t();
    l.b = w.narrow(0, l.bias, l.out);
    layers.push_back(std::move(l));
  }
  return layers;
}

// out <- G^T a, rounded as mm rounds into a fresh (aligned) tensor
void weight_gradient(const at::Tensor& G, const at::Tensor& a, at::Tensor out) {
  if (reinterpret_cast<uintptr_t>(out.data_ptr()) % kAlignment == 0) {
    at::mm_out(out, G.t(), a);
    return;
  }
  out.copy_(at::mm(G.t(), a));
}

std::tuple<at::Tensor, at::Tensor> mlp_loss_grad(const at::Tensor& w, const at::Tensor& x, const at::Tensor& y,
                                                 at::IntArrayRef slots, int64_t size, const at::Tensor& one) {
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.scalar_type() == at::kFloat && w.size(0) == size,
              "fedflat::mlp_loss_grad: w must be a contiguous float32 vector of the model's size");
  const std::vector<Layer> layers = layers_of(w, slots);
  std::vector<at::Tensor> inputs{x.flatten(1)};
  for (size_t l = 0; l + 1 < layers.size(); ++l) {
    inputs.push_back(at::relu(at::addmm(layers[l].b, inputs.back(), layers[l].Wt)));
  }
  const Layer& head = layers.back();
  const at::Tensor log_p = at::_log_softmax(at::addmm(head.b, inputs.back(), head.Wt), 1, false);
  auto [loss, total_weight] = at::nll_loss_forward(log_p, y, {}, kMean, kIgnoreIndex);
  at::Tensor G = at::nll_loss_backward(one, log_p, y, {}, kMean, kIgnoreIndex, total_weight);
  G = at::_log_softmax_backward_data(G, log_p, 1, at::kFloat);  // G_L = (p - onehot(y)) / B
  at::Tensor g = at::empty({size}, w.options());
  for (int64_t l = static_cast<int64_t>(layers.size()) - 1; l >= 0; --l) {
    const Layer& s = layers[l];
    at::Tensor bias_slice = g.as_strided({1, s.out}, {s.out, 1}, s.bias);
    at::sum_out(bias_slice, G, at::IntArrayRef{0}, true);  // dl/db_l
    weight_gradient(G, inputs[l], g.as_strided({s.out, s.in}, {s.in, 1}, s.weight));  // dl/dW_l
    if (l > 0) {
      G = at::threshold_backward(at::mm(G, s.W), inputs[l], 0);  // G_{l-1}
    }
  }
  return {loss, g};
}

}  // namespace

TORCH_LIBRARY(fedflat, m) {
  m.def("mlp_loss_grad(Tensor w, Tensor x, Tensor y, int[] slots, int size, Tensor one) -> (Tensor, Tensor)",
        &mlp_loss_grad);
}
