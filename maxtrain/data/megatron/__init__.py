"""Megatron-LM corpora (`PREFIX.bin` / `PREFIX.idx`) as a data source, in Megatron's order.

    indexed.py      the file format: open and check a pair, write one
    gpt_indices.py  GPTDataset's split, document, sample and shuffle indices
    blend.py        BlendedDataset's per-source sizes and greedy dataset index
    training/compile_cache.py        the index arrays, built once and memory-mapped from disk
    samples.py      random access to samples as token windows
    batches.py      samples -> the train step's batch, with Megatron's token switches
    checks.py       token ids within the vocabulary, EOD tokens where the switches need them
    stream.py       data.kind megatron: train and eval streams, per host, resumable
    prepare.py      text -> a Megatron pair (tools/prepare_data.py --output-format
    megatron)

Nothing here needs torch or Megatron; tests/fixtures/megatron holds what Megatron produced.
"""
