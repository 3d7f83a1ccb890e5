"""What tools/ measures, as importable modules (each tools/<name>.py runs one's main): the
train step's time, memory and compiled program (step.py), checkpoint saves (checkpoint.py),
the input pipeline (data_pipeline.py), post-training quantization on disk (ptq.py), the
attention and grouped-matmul kernels against their references (attention_kernels.py,
grouped_matmul.py), kernel time in a profile (kernel_profile.py), optimizers on one config
(optimizers.py), and maxtrain beside MaxText on the TPU compiler (maxtext.py)."""
