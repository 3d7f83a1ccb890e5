"""maxtrain: config-driven pre-training of dense and mixture-of-experts decoders on JAX.

Shape letters, one meaning each across the package (shape comments, einsum strings, names):

    B  batch rows                     T  sequence length (S: key positions in attention)
    D  model width (emb_dim)          V  vocabulary
    N  query heads                    K  key/value heads, G = N // K query heads per kv head
    H  head dim                       F  feed-forward hidden width (MLP or one expert)
    L  layers                         M  micro-batches of one step (gradient accumulation)
    E  experts                        EL experts held by one device (E / P)
    P  expert-parallel degree         C  rows per expert per device (capacity mode)
    n  tokens on one device           k  experts per token (top-k)
    R  routed assignments, n * k      Q  rows sent to one peer (expert-parallel dispatch)

The pipeline schedule (parallel/pipeline.py, its docs and the bubble formula) counts in the
letters its literature uses, which name nothing else there: S stages, R repeats (blocks of
layers per stage), M micro-batches through the stages.
"""
