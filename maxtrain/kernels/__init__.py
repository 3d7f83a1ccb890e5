"""One module per hot operation, each with a plain-XLA reference beside its fast paths:
attention (attention.py: the kernel a configured name picks, built by its backend's module:
xla_attention.py, the plain-XLA reference in its whole, banded, cached and block forms;
splash.py on TPU; tokamax_attention.py; sinks.py), the gated delta rule
(gated_delta_rule.py), grouped matmul (grouped_matmul.py, quantized_grouped_matmul.py) and
cross-entropy (cross_entropy.py). Kernels take arrays, never a layer or a config."""
