"""draftsmith.decode: the speculative decoder over a runtime.

    runtime/       models and how they run (zoo, loading, LeanLM, KV cache, kernels, quantisation, row plan)
    speculative    the decoder: rounds, policy (`KPolicy`), statistics; sampling (the exact accept rule), lookup
    batch          many prompts at once, for generating data
    head, pruned   draft kinds beyond a plain model: a head reading the target, a model with a pruned vocabulary
    spec           DraftSpec: a draft's text form, parsed and checked
    textgen, bench, floor, rows, prompts   the verbs' text path, benchmarks, generated rows, built-in prompts
"""
