"""Whole-text tokenization in the ICQS engine and the glass-box features.

The engine and the features must score the token ids of the whole prompt text tokenized as one
string, as a plain forward over the full text does. The naive reference tokenizes the whole text
with its own code, so these tests compare against it - and, to show that they can fail, check
that the old split tokenization (prefix, query and response tokenized apart) gives other ids and
other log-likelihoods on the same inputs. Tokenizers: the embedded SmolLM2 one, and two built
here without download (a SentencePiece-style Unigram with a Metaspace pre-tokenizer and BOS, and
a GPT-2-style byte-level BPE), each paired with a tiny random model of matching vocabulary.
"""

import warnings

import pytest
import torch
from _helpers import DEVICE, assert_same_scores

from icqs_fast import ICQSScorer
from icqs_fast.engine.prompt_tokens import PromptTokens, PromptTooLong, first_response_token
from icqs_fast.engine.prompts import Template
from icqs_fast.engine.reference import icqs_naive
from icqs_fast.features.extract import as_item, encode, glassbox
from icqs_fast.models import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GOOD = [("the movie was great", "positive"), ("I loved it", "positive"),
        ("a moving story about two brothers", "positive")]
BAD = [("terrible film", "positive"), ("boring", "positive"), ("wonderful", "negative")]
RESPONSES = [("a wonderful time", "positive"), ("awful acting", "negative")]
KW = dict(num_ratios=2, demos_per_set=2, sets_per_ratio=2, seed=3)
F64 = torch.float64

# Training text of the tokenizers built here: the words and template text the tests use, with
# "\n\n" and "Answering" often enough to be learnt as units (so seams differ).
CORPUS = [
    f"Sentence: {x}\nAnswer: {y}\n\nSentence: {x2}\nAnswering: {y2}\n\n"
    for x, y in GOOD + BAD + RESPONSES for x2, y2 in RESPONSES + GOOD
] + ["Review: what was it\nAnswer: positive negative\n\n"] * 20 \
    + ["### Instruction:\nwhat was it\n\n### Response:\na long and pointless exercise\n\n"] * 5


def _split_ids(tok: PromptTokens, c: int, x: str, y: str) -> tuple[list[int], list[int]]:
    """The old engine's ids: prefix, query and response tokenized apart and concatenated."""
    q = tok.encode(tok.template.format_query(x))
    r = tok.encode(tok.template.format_response(y))
    return tok.prefix_ids(c, 0) + q, r


@torch.no_grad()
def _loglik(model, prompt: list[int], resp: list[int]) -> float:
    ids = torch.tensor([prompt + resp], device=DEVICE)
    lp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(resp) - 1, device=DEVICE)
    return float(lp[pos, ids[0, len(prompt):]].sum())


def _compare(got, ref, atol=1e-4):
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a.loglik, b.loglik, atol=atol, rtol=0)
        assert a.n_response_tokens == b.n_response_tokens
        assert torch.equal(a.n_prompt_tokens, b.n_prompt_tokens)
        assert torch.equal(a.n_dropped_demos, b.n_dropped_demos)
        assert_same_scores(a, b)


# --------------------------------------------------------------------------- tokenizers


def _sentencepiece_tokenizer():
    """Unigram model, Metaspace pre-tokenizer (spaces as '▁', one prepended at the start), BOS
    added by the post-processor: the layout of Llama-2 / Mistral tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.Unigram())
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tk.train_from_iterator(CORPUS, trainers.UnigramTrainer(
        vocab_size=180, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>"))
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tk.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def _bytelevel_tokenizer():
    """GPT-2-style byte-level BPE (offsets trimmed of leading spaces, as GPT-2's are), no BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=True)
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=420, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>")


def _tiny_llama(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=vocab,
                      bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(DEVICE).eval()


def _tiny_gpt2(vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=vocab, n_positions=256,
                     bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return GPT2LMHeadModel(cfg).to(DEVICE).eval()


@pytest.fixture(scope="module")
def sp():
    tok = _sentencepiece_tokenizer()
    return _tiny_llama(len(tok)), tok


@pytest.fixture(scope="module")
def bpe():
    tok = _bytelevel_tokenizer()
    return _tiny_gpt2(len(tok)), tok


@pytest.fixture(scope="module")
def embedded():
    return load_model(device=DEVICE, dtype="float32")


# --------------------------------------------------------------------------- the rule


def test_first_response_token_rule():
    # "Answer:" | " yes": tokens [0,6) [6,7) [7,11); response starts at 7.
    assert first_response_token([(0, 6), (6, 7), (7, 11)], 7) == 2
    # A token straddling the seam ([5,9) holds response characters 7, 8) is a response token.
    assert first_response_token([(0, 5), (5, 9), (9, 11)], 7) == 1
    # A token ending exactly at the seam is the prompt's; a zero-width one at it the response's.
    assert first_response_token([(0, 7), (7, 7), (7, 9)], 7) == 1
    # Trimmed offsets (byte-level BPE drops the leading space): still after the seam.
    assert first_response_token([(0, 6), (8, 11)], 6) == 1
    # Empty response: every token is the prompt's.
    assert first_response_token([(0, 3), (3, 7)], 7) == 2


# --------------------------------------------------------------------------- embedded model


def test_embedded_engine_matches_whole_text_naive(embedded):
    """Default template, SmolLM2's tokenizer: the prefix alone ends in 'ĊĊ' where the whole
    text has 'Ċ', 'Ċ' - the old split ids differ and move the log-likelihood; the engine now
    equals the naive whole-text reference."""
    model, tok = embedded
    scorer = ICQSScorer(model, tok, GOOD, BAD, **KW)
    got = list(scorer.score(RESPONSES))
    ref = icqs_naive(model, tok, GOOD, BAD, RESPONSES, compute_dtype=F64, **KW)
    _compare(got, ref)
    assert scorer.seam_fallbacks == 0  # every prompt continued its context's cached entry
    # The old split path: other ids at the prefix/query seam, and other log-likelihoods.
    x, y = RESPONSES[0]
    lay = scorer.tokens.layouts(0, x, y, None, False)
    split_diff = 0.0
    for c in range(scorer.n_contexts):
        prompt, resp = _split_ids(scorer.tokens, c, x, y)
        assert prompt + resp != lay[c].ids
        assert tok.convert_ids_to_tokens(prompt[len(scorer.tokens.prefix_ids(c)) - 1]) == "ĊĊ"
        split_diff = max(split_diff, abs(_loglik(model, prompt, resp)
                                         - float(ref[0].loglik.flatten()[c])))
    assert split_diff > 0.02, split_diff  # far outside the 1e-4 tolerance: the test can fail


def test_stale_entry_is_detected_not_used(embedded, monkeypatch):
    """A bank entry the whole-text ids do not start with (here: the prefix tokenized alone,
    ending in 'ĊĊ', as the old engine stored it) is never used: the engine warns, computes a
    shorter entry, and still equals the reference."""
    model, tok = embedded
    monkeypatch.setattr(PromptTokens, "entry_ids", PromptTokens.prefix_ids)
    scorer = ICQSScorer(model, tok, GOOD, BAD, **KW)
    with pytest.warns(UserWarning, match="do not start with the cached prefix tokens"):
        got = list(scorer.score(RESPONSES[:1]))
    assert scorer.seam_fallbacks == scorer.n_contexts
    ref = icqs_naive(model, tok, GOOD, BAD, RESPONSES[:1], compute_dtype=F64, **KW)
    _compare(got, ref)


def test_embedded_features_score_whole_text(embedded):
    """Glass-box features: the ids are the whole text's, and sent_logprob is the mean
    log-probability of a plain forward over them. The second response starts with two spaces:
    the whole text joins the prompt's last "\n" and the first space into one token 'ĊĠ', which
    straddles the seam and is scored with the response; the old encoding (prompt and response
    tokenized apart) had 'Ċ' | 'Ġ', 'Ġind' instead."""
    model, tok = embedded
    items = [("Name a colour.", "Blue.\n\nIt is calm."), ("Indent it", "  indented code")]
    got = glassbox(model, tok, items, features=["sent_logprob"], use_chat_template=False)
    for it, row in zip(items, got, strict=True):
        e = encode(tok, as_item(it), use_chat_template=False)
        prompt_text = f"### Instruction:\n{it[0]}\n\n### Response:\n"
        whole = tok(prompt_text + it[1])["input_ids"]
        assert e.ids == whole
        assert tok.decode(e.ids[e.prompt_len:]).endswith(it[1])
        assert tok.decode(e.ids[e.instr[0]:e.instr[1]]) == it[0]
        want = _loglik(model, e.ids[:e.prompt_len], e.ids[e.prompt_len:])
        assert row["n_tokens"] == len(whole) - e.prompt_len
        assert row["sent_logprob"] == pytest.approx(want / row["n_tokens"], abs=1e-4)
    e = encode(tok, as_item(items[1]), use_chat_template=False)
    assert tok.convert_ids_to_tokens(e.ids[e.prompt_len]) == "ĊĠ"
    old = tok(f"### Instruction:\n{items[1][0]}\n\n### Response:\n")["input_ids"] \
        + tok(items[1][1], add_special_tokens=False)["input_ids"]
    assert old != e.ids


# --------------------------------------------------------------------------- built tokenizers


def test_sentencepiece_engine_matches_naive(sp):
    model, tok = sp
    scorer = ICQSScorer(model, tok, GOOD, BAD, token_budget=150, **KW)
    assert scorer.tokens.bos == [tok.bos_token_id]
    got = list(scorer.score(RESPONSES))
    ref = icqs_naive(model, tok, GOOD, BAD, RESPONSES, compute_dtype=F64, **KW)
    _compare(got, ref)
    # Seams differ here: the query alone starts with '▁Sentence' (a prepended space), the whole
    # text has no space after "\n"; so the old split ids give other log-likelihoods.
    x, y = RESPONSES[1]
    lay = scorer.tokens.layouts(1, x, y, None, False)
    diffs = []
    for c in range(scorer.n_contexts):
        prompt, resp = _split_ids(scorer.tokens, c, x, y)
        assert prompt + resp != lay[c].ids
        assert lay[c].ids == tok(scorer.tokens.prefix_text(c) + scorer.template.format_query(x)
                                 + scorer.template.format_response(y))["input_ids"]
        diffs.append(abs(_loglik(model, prompt, resp) - float(ref[1].loglik.flatten()[c])))
    assert max(diffs) > 2e-3, diffs  # 20x the tolerance: the comparison can fail


def test_sentencepiece_straddling_token_and_drop_oldest(sp):
    """A token straddling the query/response seam is scored with the response, by the engine
    and the naive reference alike: with the response template "\nAnswer: {y}", the query
    "Sentence: awful acting" and the response join into one piece '▁acting\nAnswer'. With a max
    length, dropping the oldest demonstrations is decided on whole-text lengths."""
    model, tok = sp
    tpl = Template(demo="Sentence: {x}\nAnswer: {y}\n", query="Sentence: {x}",
                   response="\nAnswer: {y}\n", separator="\n")
    kw = dict(KW, template=tpl)
    scorer = ICQSScorer(model, tok, GOOD, BAD, **kw)
    x, y = RESPONSES[1]
    lays = scorer.tokens.layouts(1, x, y, None, False)
    first = tok.convert_ids_to_tokens(lays[0].ids[lays[0].n_prompt])
    assert first == "▁acting\nAnswer", first  # it straddles the seam
    got = list(scorer.score(RESPONSES))
    _compare(got, icqs_naive(model, tok, GOOD, BAD, RESPONSES, compute_dtype=F64, **kw))
    n_full = min(len(la.ids) for la in lays)
    kw_drop = dict(kw, max_length=n_full - 1, drop_oldest_demos=True)
    got = list(ICQSScorer(model, tok, GOOD, BAD, **kw_drop).score(RESPONSES[1:]))
    ref = icqs_naive(model, tok, GOOD, BAD, RESPONSES[1:], compute_dtype=F64, **kw_drop)
    _compare(got, ref)
    assert int(got[0].n_dropped_demos.min()) >= 1
    assert int((got[0].n_prompt_tokens + got[0].n_response_tokens).max()) <= n_full - 1
    # Too long even with one demonstration: PromptTooLong, a ValueError whose reason (for the
    # CLI's per-record errors) leaves out the response index; the naive method refuses too.
    short = len(tok(tpl.format_query(x) + tpl.format_response(y))["input_ids"]) + 2
    with pytest.raises(PromptTooLong, match=r"^response 0: prompt of \d+ tokens") as exc:
        list(ICQSScorer(model, tok, GOOD, BAD, **dict(kw_drop, max_length=short))
             .score(RESPONSES[1:]))
    assert exc.value.reason.startswith("prompt of ")
    assert exc.value.reason.endswith("even with a single demonstration")
    with pytest.raises(ValueError, match="exceeds the max length"):
        icqs_naive(model, tok, GOOD, BAD, RESPONSES[1:], **dict(kw_drop, max_length=short))


def test_bytelevel_engine_matches_naive(bpe):
    model, tok = bpe
    assert tok.convert_ids_to_tokens(tok("\n\n")["input_ids"]) == ["ĊĊ"]  # a seam to differ at
    scorer = ICQSScorer(model, tok, GOOD, BAD, **KW)
    assert scorer.tokens.bos == []
    got = list(scorer.score(RESPONSES))
    ref = icqs_naive(model, tok, GOOD, BAD, RESPONSES, compute_dtype=F64, **KW)
    _compare(got, ref)
    assert scorer.seam_fallbacks == 0
    x, y = RESPONSES[0]
    lay = scorer.tokens.layouts(0, x, y, None, False)
    prompt, resp = _split_ids(scorer.tokens, 0, x, y)
    assert prompt + resp != lay[0].ids
    assert abs(_loglik(model, prompt, resp) - float(ref[0].loglik.flatten()[0])) > 1e-3


def test_features_whole_text_with_built_tokenizers(sp, bpe):
    """encode() gives the whole text's ids (BOS as the tokenizer adds it) with the response and
    instruction found by offsets, for both built tokenizers; sent_logprob matches a plain
    forward over those ids."""
    items = [("what was it", "a long and pointless exercise\n\nnegative"),
             ("I loved it", "positive")]
    for model, tok in (sp, bpe):
        got = glassbox(model, tok, items, features=["sent_logprob"], batch_size=2,
                       backend="torch")
        for it, row in zip(items, got, strict=True):
            e = encode(tok, as_item(it))
            prompt_text = f"### Instruction:\n{it[0]}\n\n### Response:\n"
            assert e.ids == tok(prompt_text + it[1])["input_ids"]
            assert tok.decode(e.ids[e.prompt_len:]).strip() == it[1].strip()
            assert tok.decode(e.ids[e.instr[0]:e.instr[1]]).strip() == it[0]
            want = _loglik(model, e.ids[:e.prompt_len], e.ids[e.prompt_len:])
            assert row["sent_logprob"] == pytest.approx(want / row["n_tokens"], abs=1e-4)


def test_slow_tokenizer_is_refused(sp):
    model, tok = sp

    class Slow:
        is_fast = False

    with pytest.raises(TypeError, match="not a fast tokenizer"):
        PromptTokens(Slow(), Template(), [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ICQSScorer(model, tok, GOOD, BAD, **KW).tokens.tok is tok
