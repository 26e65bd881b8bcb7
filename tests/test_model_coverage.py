"""Every decoder family transformers can build is scored exactly.

For each model_type of transformers' causal-LM mapping that builds from a tiny random config
(``tests/model_matrix.py``: 2 layers, hidden 64, a 16-token sliding window / chunk where the
config has one), the engine (:class:`icqs_fast.ICQSScorer`, on whatever path the capability check
chooses) is compared with the independent reference (``icqs_naive``: whole-text tokenization, one
plain forward of the model itself per prompt, float64 log-softmax): log-likelihoods within 1e-4
in fp32, identical scores, prompts longer than the window. Families with local layers are also
run with a window longer than every prompt. The coverage table of docs/MODELS.md (between the
``model-coverage`` markers) is written from these results by ``python tests/test_model_coverage.py``
and each family's row is checked here, so the table cannot drift from what the engine does.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from model_matrix import EXCLUDED, causal_lm_types, tiny_config, tiny_model

COVERAGE_DOC = Path(__file__).resolve().parents[1] / "docs" / "MODELS.md"
START, END = "<!-- model-coverage:start -->", "<!-- model-coverage:end -->"
WINDOW = 16
TOL = 1e-4
GOOD = [("The market rose sharply today.", "positive"), ("Profits fell sharply.", "negative")]
BAD = [("The market rose sharply today.", "negative"), ("Profits fell sharply.", "positive")]
RESP = [("Revenue increased by ten percent compared with last year.", "positive"),
        ("Cut.", "negative")]
# The argmax: the score a rounding difference can flip, so the strictest check (ties aside).
SETTINGS = dict(num_ratios=2, sets_per_ratio=1, demos_per_set=2, seed=0, score="argmax")
PATH_NAMES = {"cascade": "prefix bank, cascade attention", "kv-copy": "prefix bank, KV copies",
              "plain": "plain forward"}

TYPES = [t for t in causal_lm_types() if t not in EXCLUDED]


def _local_types() -> list[str]:
    """Types whose tiny config has sliding-window or chunked layers (read from the config)."""
    from icqs_fast.engine.layout import layer_attention

    out = []
    for t in TYPES:
        try:
            if any(la.local for la in layer_attention(tiny_config(t, 49152, window=WINDOW))):
                out.append(t)
        except Exception:  # noqa: BLE001 - a config error shows in the main test instead
            continue
    return out


LOCAL_TYPES = _local_types()


def _tokenizer():
    from transformers import AutoTokenizer

    from icqs_fast import models

    return AutoTokenizer.from_pretrained(models.embedded_model_dir())


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


pytestmark = [pytest.mark.matrix, pytest.mark.usefixtures("one_torch_thread")]


def score_family(model_type: str, tok, window: int = WINDOW):
    """``(plan, max |loglik diff|, scores equal, shortest prompt)`` of the engine against the
    reference on one tiny model."""
    import warnings

    from icqs_fast import ICQSScorer
    from icqs_fast.engine.reference import icqs_naive

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model(model_type, len(tok), window=window)
        scorer = ICQSScorer(model, tok, GOOD, BAD, **SETTINGS)
        got = list(scorer.score(RESP))
        ref = icqs_naive(model, tok, GOOD, BAD, RESP, **SETTINGS, compute_dtype=torch.float64)
    diff = max(float((a.loglik.double() - b.loglik.double()).abs().max())
               for a, b in zip(got, ref, strict=True))
    same = all(_scores_agree(a, b) for a, b in zip(got, ref, strict=True))
    shortest = min(int(r.n_prompt_tokens.min()) for r in got)
    return scorer.plan, diff, same, shortest


def _scores_agree(a, b) -> bool:
    """Engine and reference scores are equal wherever the reference's best mixture ratio beats
    the second by more than 2 * TOL nats (closer ones are ties that rounding may flip: a tiny
    random model that barely reads its context)."""
    def decided(ll: torch.Tensor) -> bool:
        top = ll.double().topk(2).values
        return bool(top[0] - top[1] > 2 * TOL)

    ll = b.loglik
    if decided(ll.mean(dim=1)) and a.score != b.score:
        return False
    return all(x == y for j, (x, y) in enumerate(zip(a.score_per_set, b.score_per_set,
                                                     strict=True)) if decided(ll[:, j]))


def coverage_row(model_type: str, plan) -> str:
    """The docs/MODELS.md table row of one family."""
    return (f"| `{model_type}` | {PATH_NAMES[plan.path]} | {plan.uses or '-'} | "
            f"{plan.why_not_bank or '-'} |")


def readme_rows() -> dict[str, str]:
    text = COVERAGE_DOC.read_text(encoding="utf-8")
    block = text[text.index(START):text.index(END)]
    rows = {}
    for line in block.splitlines():
        m = re.match(r"\| `([^`]+)` \|", line)
        if m:
            rows[m.group(1)] = line
    return rows


def summary_line(rows: dict[str, str]) -> str:
    """The counts line above the table, from the rows."""
    paths = {k: sum(f"| {v} |" in r for r in rows.values()) for k, v in PATH_NAMES.items()}
    bank = paths["cascade"] + paths["kv-copy"]
    return (f"{len(rows)} families scored exactly, none refused: {bank} on the prefix bank "
            f"({paths['cascade']} with cascade attention, {paths['kv-copy']} with KV copies), "
            f"{paths['plain']} on the plain forward; {len(EXCLUDED)} model types of the mapping "
            "do not build a text-only model from a tiny config (`tests/model_matrix.py` "
            "EXCLUDED, with reasons).")


@pytest.mark.parametrize("model_type", TYPES)
def test_family_is_scored_exactly(model_type, tok):
    plan, diff, same, shortest = score_family(model_type, tok)
    assert diff <= TOL, f"{model_type} ({plan.path}): loglik differs by {diff:.3g}"
    assert same, f"{model_type} ({plan.path}): scores differ from the reference"
    assert shortest > WINDOW  # every prompt runs past the window
    row = readme_rows().get(model_type)
    assert row == coverage_row(model_type, plan), (
        f"docs/MODELS.md coverage row of {model_type} is {row!r}, the engine gives "
        f"{coverage_row(model_type, plan)!r}: run `python tests/test_model_coverage.py`")


@pytest.mark.parametrize("model_type", LOCAL_TYPES)
def test_local_family_with_prompts_inside_the_window(model_type, tok):
    """The same families with a window longer than every prompt (their local layers then see
    everything before them): still exact."""
    plan, diff, same, _ = score_family(model_type, tok, window=512)
    assert diff <= TOL and same, f"{model_type} ({plan.path}): loglik differs by {diff:.3g}"


def test_readme_lists_every_family_once_with_its_counts():
    rows = readme_rows()
    assert sorted(rows) == sorted(TYPES)
    text = COVERAGE_DOC.read_text(encoding="utf-8")
    block = text[text.index(START):text.index(END)]
    assert summary_line(rows) in block
    assert len(LOCAL_TYPES) >= 10  # the window tests cover a real share of the families


def test_path_messages(tok):
    """The capability check says each path once, in one line naming what it uses."""
    from icqs_fast.engine.capability import model_plan

    v = len(tok)
    cases = {
        "llama": "llama: prefix bank, cascade attention",
        "mistral": "mistral: prefix bank, cascade attention, sliding-window masks (16 tokens, "
                   "2 of 2 layers)",
        "deepseek_v2": "deepseek_v2: prefix bank, per-row KV copies",
        "mamba": "mamba: plain forward, no prefix sharing, 2 of 2 layers without attention "
                 "(linear_attention), because the prefix bank holds attention keys/values only",
    }
    for t, want in cases.items():
        assert model_plan(tiny_model(t, v)).message == want
    own = model_plan(tiny_model("prophetnet", v))
    assert own.message.startswith("prophetnet: plain forward, no prefix sharing, scored from "
                                  "the model's own logits")


def write_readme() -> None:
    """Score every family and write the coverage block of docs/MODELS.md from the results."""
    tok = _tokenizer()
    rows, bad = {}, []
    for t in TYPES:
        plan, diff, same, _ = score_family(t, tok)
        if diff > TOL or not same:
            bad.append(f"{t}: {diff:.3g}")
        rows[t] = coverage_row(t, plan)
        print(rows[t], flush=True)
    if bad:
        raise SystemExit("not exact: " + ", ".join(bad))
    block = "\n".join([
        START, "", summary_line(rows), "",
        "| family (model_type) | path | uses | why not the prefix bank |", "|---|---|---|---|",
        *[rows[t] for t in sorted(rows)], "", END])
    text = COVERAGE_DOC.read_text(encoding="utf-8")
    text = text[:text.index(START)] + block + text[text.index(END) + len(END):]
    COVERAGE_DOC.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(write_readme())
