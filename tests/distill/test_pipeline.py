"""The distillation run's held-out split: evaluation never sees a training prompt."""

import pytest
import torch

from draftsmith.decode.runtime.errors import DraftsmithError
from draftsmith.decode.prompts import Prompt, load_prompts
from draftsmith.distill.pipeline import split_prompts


def test_split_holds_out_the_first_n_of_every_domain() -> None:
    prompts = load_prompts("code,chat")
    train, held = split_prompts(prompts, 3)
    assert [p.id for p in held] == [p.id for p in prompts if p.domain == "code"][:3] + \
        [p.id for p in prompts if p.domain == "chat"][:3]
    assert not {p.id for p in train} & {p.id for p in held}
    assert len(train) + len(held) == len(prompts)


def test_split_needs_both_sides() -> None:
    with pytest.raises(DraftsmithError):
        split_prompts([Prompt("a", "x", "hi")], 1)


WORDS = "the a of to and in is it that for on with as was be by this are or at from code data".split()


def _tiny_target_and_prompts(tmp_path, per_domain: int):
    """A tiny saved target over WORDS and a prompts file with `per_domain` prompts in code and chat."""
    import json

    from tests import helpers

    tok = helpers.word_tokenizer(["[UNK]", "<s>", "</s>", *WORDS], eos="</s>", bos="<s>")
    target = helpers.save_tiny(tmp_path / "target", tok, 0, eos_id=2, bos_id=1, layers=2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(WORDS[i:i + 3]), "domain": d}) + "\n"
                               for i in range(per_domain) for d in ("code", "chat")))
    return target, prompts


def test_a_diverging_short_run_skips_its_steps_says_so_and_keeps_the_earlier_best(tmp_path) -> None:
    """lr 1e12 makes the loss non-finite after the first update: those steps are skipped (fewer than max_bad_steps),
    the run ends normally, and distill.json says how many were skipped and which draft was kept."""
    import json

    from draftsmith.distill.pipeline import DistillConfig, run_distill
    from draftsmith.distill.train import TrainConfig

    target, prompts = _tiny_target_and_prompts(tmp_path, 4)
    cfg = DistillConfig(draft=f"derive:{target}:keep=1", max_new_tokens=4, eval_per_domain=1, gen_batch_size=4,
                        train=TrainConfig(lr=1e12, steps=3, warmup_steps=0, batch_size=2, eval_every=1, save_every=1,
                                          max_grad_norm=0.0))
    r = run_distill(str(target), cfg.draft, tmp_path / "out", cfg, prompts=str(prompts))
    on_disk = json.loads((tmp_path / "out" / "distill.json").read_text())
    assert on_disk["skipped_steps"] == r["skipped_steps"] >= 1
    assert f"{r['skipped_steps']} step(s) had a non-finite loss" in on_disk["skipped_note"]
    best = r["train_summary"]["best_step"]
    assert f"best/ is the draft of step {best}" in on_disk["skipped_note"] and best < 3
    assert r["alpha_after"] >= r["alpha_before"]


def test_distill_trains_on_a_data_folder_made_before(tmp_path) -> None:
    """`data_dir`: the rows of a gen-data folder are trained on as they are (none generated); the held-out prompts
    still come from `prompts`."""
    from draftsmith.distill.data import generate_data
    from draftsmith.distill.pipeline import DistillConfig, run_distill
    from draftsmith.distill.train import TrainConfig
    from draftsmith.decode.runtime.loading import load
    from draftsmith.decode.prompts import Prompt

    target, prompts = _tiny_target_and_prompts(tmp_path, 2)
    t = load(str(target))
    rows = [Prompt(f"g{i}", "chat", " ".join(WORDS[i + 5:i + 9])) for i in range(7)]
    generate_data(t, t, rows, tmp_path / "gen", max_new_tokens=5, temperature=0.0, progress=False)
    cfg = DistillConfig(draft=f"derive:{target}:keep=1", max_new_tokens=4, eval_per_domain=1,
                        data_dir=str(tmp_path / "gen"),
                        train=TrainConfig(steps=2, warmup_steps=0, batch_size=2, eval_every=1, save_every=1))
    r = run_distill(str(target), cfg.draft, tmp_path / "out", cfg, prompts=str(prompts))
    assert r["data_rows"] == 7 and r["train_prompts"] == 7 and r["held_out_prompts"] == 2
    assert not (tmp_path / "out" / "data").exists()  # nothing generated


def test_gen_data_writes_on_policy_rows_in_the_drafts_int4_copy_and_scores_them(tmp_path) -> None:
    """`onpolicy_quant`: gen-data's on-policy rows come from the draft's int4 copy (recorded in the folder's
    settings), and the target's compact top-k cache of them is computed where training finds it."""
    import json

    from draftsmith.decode.runtime.quant import int4_ok
    from draftsmith.distill.pipeline import DistillConfig, gen_data
    from draftsmith.distill.train import TrainConfig

    if not int4_ok():
        pytest.skip("no draftsmith int4 kernel here")
    target, prompts = _tiny_target_and_prompts(tmp_path, 3)
    cfg = DistillConfig(draft=str(target), data="draft", onpolicy_quant="int4", max_new_tokens=5, gen_batch_size=4,
                        train=TrainConfig(teacher="cache", teacher_topk=4, teacher_cache_dtype="float16"))
    got = gen_data(str(target), tmp_path / "rows", cfg, prompts=str(prompts), progress=False)
    assert len(got["dataset"]) == 6 and got["how"] == "computed" and got["cache"].k == 4
    assert got["cache"].values.dtype == torch.float16 and len(got["cache"]) == 6
    assert json.loads((tmp_path / "rows" / "settings.json").read_text())["draft_quant"] == "int4"
    for bad in ({"onpolicy_quant": "int2"}, {"onpolicy_calib": "c.json"}):
        with pytest.raises(ValueError, match="onpolicy"):
            DistillConfig(**bad)


def test_several_samples_per_prompt_are_copies_with_their_own_ids() -> None:
    from draftsmith.distill.pipeline import DistillConfig, repeat_prompts

    prompts = [Prompt("a", "code", "x"), Prompt("b", "chat", "y")]
    rows = repeat_prompts(prompts, 3)
    assert [p.id for p in rows] == ["a", "a~2", "a~3", "b", "b~2", "b~3"]
    assert [p.prompt for p in rows] == ["x"] * 3 + ["y"] * 3 and [p.domain for p in rows][3:] == ["chat"] * 3
    assert repeat_prompts(prompts, 1) == prompts
    with pytest.raises(ValueError, match="samples_per_prompt > 1 needs data_temperature > 0"):
        DistillConfig(samples_per_prompt=2, data_temperature=0.0)
    with pytest.raises(ValueError, match="samples_per_prompt must be >= 1"):
        DistillConfig(samples_per_prompt=0)
