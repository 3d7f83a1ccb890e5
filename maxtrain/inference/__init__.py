"""Generation from a trained or imported model: the decode cache (layers/kv_cache.py), token
sampling (sampling.py) and the jitted prefill and decode steps with their loop (decode.py).
maxtrain/generate.py is the command line."""
