"""Calibrated int4 drafts (`decode.runtime.quant.gptq_groups`, `int4:MODEL:calib=FILE`): GPTQ against a float64 brute force
of the sequential update it stands for, its identity case (no inputs' correlation: plain rounding), a lower output
error than plain rounding on correlated inputs (with a negative control), the calibration file's errors, the
calibrated runner cached and exact in the decoder."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.runtime.quant import GROUP, Int4Linear, deinterleave_int4, gptq_groups, quantize_groups, read_calib, write_calib
from draftsmith.decode.runtime.runner import make_runner
from draftsmith.decode.spec import DraftSpec
from draftsmith.decode.speculative import KPolicy, generate
from tests import helpers
from tests.decode.runtime.test_int4 import needs_int4


def brute_gptq(weight: torch.Tensor, hessian: torch.Tensor, damp: float = 0.01):
    """The sequential rounding GPTQ computes, by brute force in float64: column c rounded with its group's pair
    (fitted to the group as updated when its first column comes up), and its error e taken off every later column
    j by e * [H_c^-1]_0j / [H_c^-1]_00, H_c^-1 inverted anew from the rows and columns c.. of the damped Hessian."""
    N, K = weight.shape
    W = weight.double().clone()
    H = hessian.double().clone()
    d = H.diagonal()
    d[d <= 0] = 1.0
    d.add_(damp * float(d.mean()))
    q = torch.empty(N, K, dtype=torch.uint8)
    sm = torch.empty(N, K // GROUP, 2, dtype=torch.float16)
    for c in range(K):
        if c % GROUP == 0:
            pair = quantize_groups(W[:, c:c + GROUP])[1][:, 0]
            sm[:, c // GROUP] = pair
            s, lo = pair[:, 0].double(), pair[:, 1].double()
        qc = ((W[:, c] - lo) / s).round().clamp(0, 15)
        q[:, c] = qc.to(torch.uint8)
        e = W[:, c] - (qc * s + lo)
        inv = torch.linalg.inv(H[c:, c:])
        W[:, c + 1:] -= e[:, None] * (inv[0, 1:] / inv[0, 0])[None, :]
    return q, sm


def output_error(weight, x, q, sm) -> float:
    N, K = weight.shape
    w = (q.reshape(N, -1, GROUP).double() * sm[..., :1].double() + sm[..., 1:].double()).reshape(N, K)
    return float((x.double() @ (weight.double() - w).t()).square().sum())


def correlated(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g, dtype=torch.float64) * 0.4 + torch.eye(k, dtype=torch.float64)
    return torch.randn(n, k, generator=g, dtype=torch.float64) @ mix


@pytest.mark.parametrize("n,k,block", [(24, 64, 32), (40, 128, 128), (17, 96, 64)])
def test_gptq_matches_its_float64_brute_force(n: int, k: int, block: int) -> None:
    torch.manual_seed(n)
    weight = torch.randn(n, k, dtype=torch.float64)
    x = correlated(300, k, n)
    H = x.t() @ x
    q, sm = gptq_groups(weight, H, block=block)
    bq, bsm = brute_gptq(weight, H)
    assert torch.equal(q, bq) and torch.equal(sm, bsm)


def test_gptq_with_no_correlation_is_plain_rounding() -> None:
    torch.manual_seed(1)
    weight = torch.randn(50, 160)
    q, sm = gptq_groups(weight, torch.eye(160) * 3.0)
    plain_q, plain_sm = quantize_groups(weight)
    assert torch.equal(q, plain_q) and torch.equal(sm, plain_sm)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gptq_rounds_the_outputs_closer_than_plain_rounding(seed: int) -> None:
    """On correlated inputs the layer's output error (sum over the inputs of |x (W - Wq)^T|^2) falls below plain
    rounding's by over a quarter; negative control: GPTQ fitted to other inputs' Hessian (uncorrelated) does not."""
    torch.manual_seed(seed)
    weight = torch.randn(64, 128)
    x = correlated(400, 128, seed)
    plain = output_error(weight, x, *quantize_groups(weight))
    fitted = output_error(weight, x, *gptq_groups(weight, x.t() @ x))
    assert fitted < 0.75 * plain
    other = correlated(400, 128, seed + 100)
    assert output_error(weight, x, *gptq_groups(weight, other.t() @ other)) > fitted


def test_calibration_files_and_specs(tmp_path) -> None:
    path = write_calib(tmp_path / "c.json", [[1, 2, 3], [], [4]])
    cal = read_calib(path)
    assert cal.sequences == ((1, 2, 3), (4,)) and len(cal.key) == 32
    assert read_calib(write_calib(tmp_path / "d.json", [[1, 2, 3], [4]])).key == cal.key
    assert read_calib(write_calib(tmp_path / "e.json", [[1, 2, 4]])).key != cal.key
    d = DraftSpec.parse("int4:m:calib=c.json")
    assert (d.kind, d.weights, d.calibration) == ("int4", "m", tmp_path.__class__("c.json"))
    assert DraftSpec.parse("int4:m").calibration is None
    for bad in ("m:calib=c.json", "int4::calib=c.json", "int4:m:calib="):
        with pytest.raises(DraftsmithError, match="int4:MODEL:calib=FILE"):
            DraftSpec.parse(bad)
    with pytest.raises(DraftsmithError, match="no such calibration file"):
        read_calib(tmp_path / "missing.json")
    for text in ("{", json.dumps({"format": "other", "sequences": [[1]]}),
                 json.dumps({"format": "draftsmith-calib-1", "sequences": [[1, -2]]}),
                 json.dumps({"format": "draftsmith-calib-1", "sequences": []})):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(DraftsmithError, match="not a calibration file"):
            read_calib(tmp_path / "bad.json")
    with pytest.raises(DraftsmithError, match="at least one"):
        write_calib(tmp_path / "f.json", [[]])


@needs_int4
def test_a_calibrated_int4_draft_is_cached_closer_and_exact(tmp_path, monkeypatch) -> None:
    """`make_runner(quantize="int4", calib=...)`: GPTQ's weights (other nibbles than plain rounding's), computed once
    and read back from the cache the next time (the same bits), rebuilt over a damaged cache file; the decoder with
    it stays exact (greedy, the target alone's tokens at several K)."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    V = 61
    hf = helpers.tiny_llama(9, V, hidden=128, max_positions=512)
    gen = torch.Generator().manual_seed(0)
    cal = read_calib(write_calib(tmp_path / "c.json", [torch.randint(0, V, (n,), generator=gen).tolist()
                                                       for n in (40, 70, 30)]))
    plain = make_runner(hf, 128, quantize="int4")
    made = make_runner(hf, 128, quantize="int4", calib=cal)
    files = list((tmp_path / "cache" / "derived" / "int4-gptq").glob("*.safetensors"))
    assert len(files) == 1

    def int4_layers(r):
        return {n: m for n, m in r.named_modules() if isinstance(m, Int4Linear)}

    assert int4_layers(made).keys() == int4_layers(plain).keys()
    assert any(not torch.equal(a.packed, b.packed) for a, b in zip(int4_layers(made).values(),
                                                                     int4_layers(plain).values()))
    again = make_runner(hf, 128, quantize="int4", calib=cal)
    for a, b in zip(int4_layers(made).values(), int4_layers(again).values()):
        assert torch.equal(a.packed, b.packed) and torch.equal(a.sm, b.sm)
        q, sm = deinterleave_int4(a.packed, a.sm, a.out_features)
        assert int(q.max()) <= 15 and torch.isfinite(sm.float()).all()
    files[0].write_bytes(b"not safetensors")
    rebuilt = make_runner(hf, 128, quantize="int4", calib=cal)
    for a, b in zip(int4_layers(made).values(), int4_layers(rebuilt).values()):
        assert torch.equal(a.packed, b.packed)
    target = make_runner(hf, 128)
    for prompt in ([5, 6], [1, 2, 3, 4, 9]):
        ref = generate(target, prompt, max_new_tokens=30).tokens
        for k in (1, 4):
            out = generate(target, prompt, draft=make_runner(hf, 128, quantize="int4", calib=cal), max_new_tokens=30,
                           policy=KPolicy(k=k))
            assert out.tokens == ref, (prompt, k)
    with pytest.raises(DraftsmithError, match="beyond the draft's vocabulary"):
        make_runner(hf, 128, quantize="int4", calib=read_calib(write_calib(tmp_path / "big.json", [[V + 3]])))
