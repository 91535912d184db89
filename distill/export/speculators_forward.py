"""Runs INSIDE speculators' own environment (distill.export.speculators_env), never in draftsmith's: speculators
EAGLE-3 folders read by speculators' own classes and driven as speculators' trainer drives them.

    ENV/bin/python -I speculators_forward.py --versions          # JSON: the versions it runs on (and the import check)
    ENV/bin/python -I speculators_forward.py --inputs IN --steps 3 --attn default,eager FOLDER OUT [FOLDER OUT ...]

Each FOLDER is loaded by `Eagle3DraftModel.from_pretrained` (its config's verifier is a local HF folder, which
gives the embedding: see `load`). IN (safetensors) holds, per row r, `tokens.r` (T,) and `hidden.r` (L+1, T, H),
the target's hidden state entering each layer (HF's output_hidden_states); the features are the layers the loaded
config names, in its order. The rows become one batch as speculators' trainer makes it: each a sample as its
BaseDataset gives it, shifted by `shift_batch` (entry t reads the features of token t and the embedding of token
t+1; positions from 1), packed by `CollateFn`. The model's TTT forward runs `--steps` steps (later steps read the
previous step's output hidden and the next true token, as in training), and a hook on `lm_head` keeps each step's
logits. OUT (safetensors) per attention implementation a: `a.logits.r.j` (T-1, N) at step j = 1..steps, and
`a.tokens.r.j` (T-1,) the step's argmax as target ids (draft id + d2t); metadata `versions` and `embedding`. The
last line printed is the versions as JSON. Safetensors only, both ways: nothing is unpickled.
"""

from __future__ import annotations

import argparse
import json
import sys


def versions() -> dict[str, str]:
    from importlib.metadata import version

    import speculators  # noqa: F401  (the import is the check: the package imports on the CPU)

    return {name: version(name) for name in ("speculators", "torch", "transformers", "datasets")}


def load(folder: str, attn: str):
    """The folder as speculators loads it, in float64. `attn` "default" keeps speculators' choice (its flex
    attention); another name ("eager", "sdpa") is set on the layer config before construction, where the model
    picks its mask builder.

    speculators 0.9.0 with transformers 5.19 leaves the embedding uninitialised when the checkpoint has none (vLLM
    shares the target's, so our export writes none): `from_pretrained` fills it from the verifier only if it is
    still NaN, and the loader materialises missing weights as empty memory, not as the NaN the model set. So the
    verifier's embedding is loaded explicitly by speculators' own loader (what its DFlash model does always)."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    if attn != "default":
        config.transformer_layer_config._attn_implementation = attn
    model = Eagle3DraftModel.from_pretrained(folder, config=config, dtype=torch.float64).eval()
    before = model.embed_tokens.weight.detach().clone()
    model._load_verifier_weights(overwrite_embed_tokens=True)
    return model, torch.equal(before, model.embed_tokens.weight)


def batch(model, data: dict, rows: list[int]) -> dict:
    """The rows as speculators' trainer batches them, packed to a multiple of 128 entries (flex attention's block:
    its mask extension across TTT steps assumes whole blocks; the padding has document id -1)."""
    import torch
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    ids, samples = model.config.eagle_aux_hidden_state_layer_ids, []
    for r in rows:
        tokens, hidden = data[f"tokens.{r}"], data[f"hidden.{r}"].to(torch.float64)
        T = tokens.shape[0]
        samples.append({"hidden_states": torch.cat([hidden[i] for i in ids], dim=-1),  # (T, 3H), the config's order
                        "input_ids": tokens, "verifier_last_hidden_states": hidden[-1],
                        "loss_mask": torch.ones(T, dtype=torch.long), "lengths": torch.tensor([T]),
                        "position_ids": torch.arange(T)})
    total = sum(len(s["input_ids"]) - 1 for s in samples)
    collate = CollateFn(-(-total // 128) * 128, model.config.transformer_layer_config.hidden_size, len(ids),
                        dtype=torch.float64, preprocess=shift_batch)
    return collate(samples)


def run(model, data: dict, steps: int) -> dict:
    """{logits.r.j, tokens.r.j} for every row r and TTT step j, from one forward over the packed batch."""
    import torch

    rows = sorted({int(k.split(".")[1]) for k in data if k.startswith("tokens.")})
    b, captured = batch(model, data, rows), []
    hook = model.lm_head.register_forward_hook(lambda module, args, output: captured.append(output.detach()[0]))
    try:
        with torch.no_grad():  # no verifier_last_hidden_states: the forward returns its draft tokens, no loss
            model(hidden_states=b["hidden_states"], input_ids=b["input_ids"], document_ids=b["document_ids"],
                  position_ids=b["position_ids"], ttt_steps=steps)
    finally:
        hook.remove()
    out, start = {}, 0
    for r in rows:
        E = data[f"tokens.{r}"].shape[0] - 1
        for j, logits in enumerate(captured, start=1):
            draft = logits[start : start + E].argmax(-1)
            out[f"logits.{r}.{j}"] = logits[start : start + E].contiguous()
            out[f"tokens.{r}.{j}"] = draft + model.d2t[draft] if model.d2t is not None else draft
        start += E
    return out


def main(argv: list[str]) -> int:
    from_doc = __doc__.splitlines()[0]
    p = argparse.ArgumentParser(description=from_doc)
    p.add_argument("--versions", action="store_true")
    p.add_argument("--inputs")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--attn", default="default", help="comma-separated: default (speculators' flex), eager, sdpa")
    p.add_argument("jobs", nargs="*", help="FOLDER OUT pairs")
    a = p.parse_args(argv)
    if not a.versions:
        from safetensors.torch import load_file, save_file

        if not a.inputs or not a.jobs or len(a.jobs) % 2:
            p.error("--inputs and FOLDER OUT pairs are needed")
        data = load_file(a.inputs)
        for folder, out in zip(a.jobs[::2], a.jobs[1::2]):
            result, embedding = {}, {}
            for attn in a.attn.split(","):
                model, embedding[attn] = load(folder, attn)
                result |= {f"{attn}.{k}": v for k, v in run(model, data, a.steps).items()}
            save_file(result, out, metadata={"versions": json.dumps(versions()), "embedding": json.dumps(
                {"loaded_by_from_pretrained": embedding})})
    print(json.dumps(versions()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
