"""Evaluation of a model's parameters: held-out loss (loss.py) and log-likelihood tasks in the
lm-evaluation-harness style (tasks.py: the JSONL format and n-shot prompts; scoring.py: the
jitted log-likelihood of continuations; harness.py: accuracies). The train loop
(train.eval_tasks) and `python -m maxtrain.evaluate` run the same code on the same batches."""
