"""The numbers the compiled kernels and the models agree on: how routing weights are made, and which
activation a kernel applies. Plain constants, so that the kernels need no model code and a model's
edit recompiles no kernel."""

# How each family turns router logits into expert weights (gguf's expert_gating_func values).
GATING_SOFTMAX = 1
GATING_SIGMOID = 2
GATING_SOFTMAX_SELECTED = 3  # softmax over the selected logits only (gpt-oss)
# Our own: the router only selects, each selected expert counts with weight 1 (the MoEfied demo,
# where all experts together are exactly the dense FFN). The demo's family gives it as a default.
GATING_SELECT = 100

# The gated activations the kernels apply between gate/up and down.
ACT_SILU = 0  # silu(gate) * up
ACT_GELU_TANH = 1  # gelu(gate, tanh approximation) * up (Gemma)
ACT_OAI = 2  # gpt-oss: clamped gate and up, gate * sigmoid(1.702 gate) * (up + 1)
SWIGLU_LIMIT = 7.0
SWIGLU_ALPHA = 1.702

# From this many tokens on, a quantized dense matrix is decoded once per call (in tiles) and multiplied
# by a float GEMM, except on the CPU where the prompt tiles read its type (super-blocks); below it, the
# kernels multiply the blocks in place. One threshold for the CPU and the device: both trade a decode
# of the whole matrix against reading it once per token.
GEMM_TOKENS = 16
