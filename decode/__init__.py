"""draftsmith.decode: model zoo and loading, KV cache, sampling math, the speculative decoder, benchmarks."""
