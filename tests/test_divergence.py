"""Places where the fast path could silently diverge from what the model computes: the
fused-head check forward, one dtype/device policy for the token-stats ops on every
backend, per-item ``softmax_combo``, amortised ``PrefixBank`` growth and the KV-copy path on
sliding-window models."""

import pytest
import torch
from test_token_stats import compare, logit_refs

from icqs_fast import ops

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BACKENDS = ["torch", "cpp", "triton"]


# --------------------------------------------------------------------------- dtype / device policy


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32, None),
                                    (torch.float16, torch.float32, torch.bfloat16),
                                    (torch.float32, torch.float16, torch.float32)])
def test_mixed_dtypes_give_one_result_on_every_backend(dtypes):
    """A bf16 body with an fp32 head (and other mixes) is promoted to the common dtype before
    dispatch: every backend returns the float64 reference of the promoted inputs. (Before,
    triton raised a TypeError on what cpp and torch computed.)"""
    hd, wd, bd = dtypes
    n, h, v = 11, 16, 389
    hid = torch.randn(n, h).to(hd)
    w = (torch.randn(v, h) / 3).to(wd)
    b = None if bd is None else torch.randn(v).to(bd)
    t = torch.randint(0, v, (n,))
    t[2] = -100
    refs = logit_refs(hid.float(), w.float(), t, None if b is None else b.float())
    for be in BACKENDS:
        compare(ops.linear_token_stats(hid, w, t, bias=b, backend=be, chunk_vocab=100), *refs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unsupported_dtype_same_error_everywhere(backend):
    hid, w, t = torch.randn(3, 8, dtype=torch.float64), torch.randn(50, 8), torch.tensor([1, 2, 3])
    with pytest.raises(TypeError, match=r"^hidden must be float32, float16 or bfloat16, got "
                                        r"torch.float64$"):
        ops.linear_token_stats(hid, w, t, backend=backend)


@pytest.mark.parametrize("which", ["weight", "targets", "bias"])
def test_device_mismatch_same_error_everywhere(which):
    """One input on the 'meta' device: every backend raises the same ValueError, naming each
    input's device, before any backend (or the targets' range check) runs."""
    args = {"hidden": torch.randn(4, 8), "weight": torch.randn(50, 8),
            "targets": torch.tensor([1, 2, 3, 4]), "bias": torch.randn(50)}
    args[which] = args[which].to("meta")
    msgs = set()
    for be in BACKENDS:
        with pytest.raises(ValueError, match="needs all inputs on one device") as ei:
            ops.linear_token_stats(args["hidden"], args["weight"], args["targets"],
                                   bias=args["bias"], backend=be)
        msgs.add(str(ei.value))
    assert msgs == {f"linear_token_stats needs all inputs on one device; got hidden on cpu, "
                    f"weight on {'meta' if which == 'weight' else 'cpu'}, targets on "
                    f"{'meta' if which == 'targets' else 'cpu'}, bias on "
                    f"{'meta' if which == 'bias' else 'cpu'}"}
    msgs = set()
    for be in BACKENDS:
        with pytest.raises(ValueError, match="needs all inputs on one device") as ei:
            ops.token_stats(torch.randn(4, 50), torch.tensor([1, 2, 3, 4], device="meta"),
                            backend=be)
        msgs.add(str(ei.value))
    assert msgs == {"token_stats needs all inputs on one device; got logits on cpu, targets on "
                    "meta"}


# --------------------------------------------------------------------------- fused-head check


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from icqs_fast.models import embedded_model_dir

    return AutoTokenizer.from_pretrained(embedded_model_dir())


def _llama(vocab=300, cls=None, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=vocab,
                      max_position_embeddings=512, **kw)
    return (cls or LlamaForCausalLM)(cfg).eval()


def _head_model(kind: str, vocab: int = 300):
    """Tiny random models whose own logits are not ``h @ W.T``, except the 'plain' ones."""
    from transformers import (
        CohereConfig,
        CohereForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        LlamaForCausalLM,
    )

    torch.manual_seed(0)
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=vocab)
    if kind == "llama-plain":
        return _llama(vocab)
    if kind == "llama-scaled":  # post-processing no config attribute announces

        class ScaledLlama(LlamaForCausalLM):
            def forward(self, *args, **kwargs):
                out = super().forward(*args, **kwargs)
                out.logits = out.logits * 0.5
                return out

        return _llama(vocab, cls=ScaledLlama)
    if kind == "cohere":  # logits * config.logit_scale (0.0625 by default)
        return CohereForCausalLM(CohereConfig(**small, eos_token_id=2, pad_token_id=0)).eval()
    # Gemma2 softcaps its logits: cap * tanh(z / cap). A random tiny model's logits are ~0.1, far
    # below the real cap of 30, so a cap of 0.1 is what makes it bite here.
    cap = None if kind == "gemma2-plain" else 0.1
    # All layers global: this test is about the head (windows are tested below).
    cfg = Gemma2Config(**small, head_dim=16, final_logit_softcapping=cap,
                       layer_types=["full_attention"] * 2)
    return Gemma2ForCausalLM(cfg).eval()


GOOD = [("the movie was great", "positive"), ("dull", "negative")]
BAD = [("terrible film", "positive"), ("wonderful", "negative")]
KW = dict(num_ratios=2, demos_per_set=1, sets_per_ratio=1)


@pytest.mark.parametrize("kind,message", [
    ("llama-scaled", "llama: prefix bank, cascade attention, logit scale 0.5 (fitted)"),
    ("cohere", "cohere: prefix bank, cascade attention, logit scale 0.0625 (logit_scale)"),
    ("gemma2", "gemma2: prefix bank, cascade attention, attention softcapping, "
               "final-logit softcapping 0.1"),
])
def test_post_processed_logits_are_scored(tokenizer, kind, message):
    """A model whose forward post-processes its logits (a scale no config attribute announces,
    Cohere's logit_scale, Gemma 2's final softcap) is scored through the fused head with that
    epilogue: the engine equals the naive reference (which reads the model's own logits), the
    path message names the epilogue, and the glass-box sentence log-prob equals the one from the
    model's own log-probabilities."""
    from icqs_fast import ICQSScorer
    from icqs_fast.engine.reference import icqs_naive
    from icqs_fast.features.extract import as_item, encode, glassbox

    model = _head_model(kind, len(tokenizer))
    resp = [("the plot was thin", "negative"), ("a joy", "positive")]
    scorer = ICQSScorer(model, tokenizer, GOOD, BAD, **KW)
    assert scorer.plan.message == message
    eng = list(scorer.score(resp))
    ref = icqs_naive(model, tokenizer, GOOD, BAD, resp, **KW, compute_dtype=torch.float64)
    for e, r in zip(eng, ref, strict=True):
        torch.testing.assert_close(e.loglik, r.loglik, atol=1e-4, rtol=0)
    std = glassbox(model, tokenizer, [("Say hi", "Hi!")], features=["sent_logprob"])
    enc = encode(tokenizer, as_item(("Say hi", "Hi!")))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([enc.ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)[torch.arange(enc.prompt_len - 1, len(enc.ids) - 1),
                                        torch.tensor(enc.ids[enc.prompt_len:])]
    assert std[0]["sent_logprob"] == pytest.approx(float(lp.mean()), abs=1e-4)


def test_unknown_head_is_scored_from_its_own_logits(tokenizer):
    """A head the fused statistics cannot reproduce (here: logits shifted per vocabulary entry by
    a fixed random vector, which no scale or softcap explains) is not refused: the model takes
    the plain path scored from its own logits, exact against the reference."""
    from transformers import LlamaForCausalLM

    from icqs_fast import ICQSScorer
    from icqs_fast.engine.reference import icqs_naive

    class OddHead(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            g = torch.Generator().manual_seed(3)
            out.logits = out.logits + torch.randn(out.logits.shape[-1], generator=g)
            return out

    model = _llama(len(tokenizer), cls=OddHead)
    scorer = ICQSScorer(model, tokenizer, GOOD, BAD, **KW)
    assert scorer.plan.path == "plain" and scorer.plan.own_logits
    assert scorer.plan.message.startswith(
        "llama: plain forward, no prefix sharing, scored from the model's own logits")
    resp = [("the plot was thin", "negative")]
    e = next(iter(scorer.score(resp)))
    r = icqs_naive(model, tokenizer, GOOD, BAD, resp, **KW, compute_dtype=torch.float64)[0]
    torch.testing.assert_close(e.loglik, r.loglik, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["llama-plain", "gemma2-plain"])
def test_plain_head_passes_with_one_forward(tokenizer, kind):
    """A plain model passes; the check is one forward of the model, run once per model object
    (two scorers and a glass-box call later: still one)."""
    from icqs_fast import ICQSScorer
    from icqs_fast.features.extract import glassbox

    model = _head_model(kind, len(tokenizer))
    calls = []
    h = model.register_forward_pre_hook(lambda mod, args, kw: calls.append(kw["input_ids"].shape),
                                        with_kwargs=True)
    try:
        ICQSScorer(model, tokenizer, GOOD, BAD, **KW)
        ICQSScorer(model, tokenizer, GOOD, BAD, **KW)
        glassbox(model, tokenizer, [("Say hi", "Hi!")], features=["sent_logprob"])
    finally:
        h.remove()
    assert calls == [(1, 4)]


def test_check_reruns_when_the_head_changes(tokenizer):
    """The cache is keyed by the model object and its head weight's dtype, device and storage:
    a second check of the same model runs nothing, one after converting it to bf16 runs again
    (and a plain bf16 model passes within the bf16 tolerance)."""
    from icqs_fast.engine.checks import check_model

    model = _head_model("llama-plain")
    calls = []
    h = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        check_model(model)
        check_model(model)
        model.to(torch.bfloat16)
        check_model(model)  # bf16 logits vs the fp32 fused head: within the bf16 tolerance
    finally:
        h.remove()
    assert len(calls) == 2


# --------------------------------------------------------------------------- softmax_combo per item

ITEMS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Write a haiku about rain.", "Soft rain on the roof\nwhispers to the sleeping town"),
    ("Say hi", "Hi!"),
    ("Name a prime number.", "Seven is prime, and so is eleven."),
]


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return _llama(len(tokenizer))


@pytest.mark.parametrize("mode", ["standard", "selfeval-compat"])
def test_softmax_combo_does_not_depend_on_the_batch(tiny, tokenizer, mode):
    """Item A scored alone, then with B and C (one forward: batch_size=3, padded): its
    softmax_combo is the same. (Min-max over the call gave A alone 0 and A with B and C a value
    in [0, 1] set by B and C.)"""
    from icqs_fast.features.extract import glassbox

    feats = ["softmax_ent", "softmax_var", "softmax_combo"]
    alone = glassbox(tiny, tokenizer, ITEMS[:1], features=feats, mode=mode)[0]
    for batch in (ITEMS[:3], ITEMS[2::-1], [ITEMS[0], ITEMS[3]]):
        i = batch.index(ITEMS[0])
        together = glassbox(tiny, tokenizer, batch, features=feats, mode=mode, batch_size=3)
        assert together[i]["softmax_combo"] == pytest.approx(alone["softmax_combo"], rel=1e-6)
    # Not a constant: items differ.
    combos = [r["softmax_combo"] for r in glassbox(tiny, tokenizer, ITEMS, features=feats,
                                                    mode=mode, batch_size=1)]
    assert len({round(c, 9) for c in combos}) == len(ITEMS)
    assert combos[0] == alone["softmax_combo"]  # same forward: bitwise the same


def test_combo_scale_calibration_set_is_stored_and_reused(tiny, tokenizer):
    """ComboScale.fit on a calibration set fixes SelfEval's min-max constants once: fitted on
    the evaluated set itself it gives SelfEval's dataset min-max; as a stored dict it scores new
    items alone with the same values they get in a bigger call."""
    import json

    from icqs_fast.features.extract import ComboScale, glassbox

    feats = ["softmax_ent", "softmax_var", "softmax_combo"]
    rows = glassbox(tiny, tokenizer, ITEMS, features=feats, batch_size=1)
    scale = ComboScale.fit(rows)
    stored = json.loads(json.dumps(scale.as_dict()))
    assert ComboScale.from_dict(stored) == scale
    cal = glassbox(tiny, tokenizer, ITEMS, features=feats, batch_size=1, combo_scale=stored)
    ent = torch.tensor([r["softmax_ent"] for r in rows], dtype=torch.float64)
    var = torch.tensor([r["softmax_var"] for r in rows], dtype=torch.float64)
    mm = lambda t: (t - t.min()) / (t.max() - t.min())  # noqa: E731
    want = ((mm(ent) + mm(var)) / 2).tolist()
    assert [r["softmax_combo"] for r in cal] == pytest.approx(want, abs=1e-9)
    one = glassbox(tiny, tokenizer, ITEMS[1:2], features=feats, combo_scale=scale)[0]
    assert one["softmax_combo"] == cal[1]["softmax_combo"]
    # Calibration against a reference answer subtracts per-item combos like any feature.
    item = {"instruction": ITEMS[0][0], "response": ITEMS[0][1], "reference": "Paris."}
    c = glassbox(tiny, tokenizer, [item], features=feats, reference="calibrate",
                 calibration_factor=0.5)[0]
    r0 = glassbox(tiny, tokenizer, ITEMS[:1], features=feats)[0]
    rr = glassbox(tiny, tokenizer, [(ITEMS[0][0], "Paris.")], features=feats)[0]
    assert c["softmax_combo"] == pytest.approx(r0["softmax_combo"] - 0.5 * rr["softmax_combo"],
                                               abs=1e-7)
    with pytest.raises(ValueError, match="no finite softmax_ent"):
        ComboScale.fit([{"softmax_ent": float("nan"), "softmax_var": 1.0}])


# --------------------------------------------------------------------------- PrefixBank growth


def _bank_bytes(bank):
    return sum(t.numel() * t.element_size() for t in bank.keys + bank.values)


def test_prefix_bank_appends_copy_linear_bytes():
    """Appending k entries one at a time (what drop_oldest_demos does) copies O(total) bytes:
    the copies are observed independently of the bank's own count, as the bytes of the stored
    entries at each add that moved the bank to new storage. (Rebuilding the bank on every
    append copied the whole bank each time: ~k/2 times its final size here.) Every entry still
    equals a plain forward of its prefix."""
    from test_cascade import _assert_bank_equals_plain_forwards, _model

    from icqs_fast.engine.batching import PrefixBank

    model = _model("llama")
    g = torch.Generator().manual_seed(5)
    # Mostly shorter prefixes, now and then a longer one (the bank's length grows too).
    lens = [int(n) for n in torch.randint(3, 20, (32,), generator=g)]
    lens[7], lens[19], lens[29] = 25, 33, 41
    prefixes = [torch.randint(1, 300, (n,), generator=g).tolist() for n in lens]
    bank = PrefixBank(model, 0, 10_000)
    observed = rebuild_every_time = 0
    moves = 0
    for p in prefixes:
        before = _bank_bytes(bank)
        ptr = bank.keys[0].untyped_storage().data_ptr() if bank.keys else None
        bank.add([p])
        rebuild_every_time += before
        if ptr is not None and bank.keys[0].untyped_storage().data_ptr() != ptr:
            observed += before
            moves += 1
    final = _bank_bytes(bank)
    assert observed == bank.copied_bytes
    assert observed <= 4 * final, (observed, final)
    assert rebuild_every_time > 10 * final  # what the test would have seen before
    assert moves <= 16  # O(log k) reallocations (entries and length)
    e_cap, p_cap = bank.capacity
    assert len(bank) <= e_cap <= 1.5 * len(bank) + 1 and max(lens) <= p_cap
    assert [t.shape for t in bank.keys] == [(32, 2, 41, 16)] * 2
    _assert_bank_equals_plain_forwards(model, bank, prefixes)


def test_prefix_bank_failed_add_leaves_no_trace():
    """An add that fails half-way (an out-of-vocabulary id in its second chunk) has written
    states into the bank's spare rows; the bank is unchanged, and the next add into those rows
    stores exactly its own prefix (zeros past its length)."""
    from test_cascade import _assert_bank_equals_plain_forwards, _model

    from icqs_fast.engine.batching import PrefixBank

    model = _model("llama")
    g = torch.Generator().manual_seed(6)
    prefixes = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (30, 8, 9, 10, 4, 6)]
    bank = PrefixBank(model, 0, 40)
    for p in prefixes:
        bank.add([p])
    e_cap, p_cap = bank.capacity
    assert e_cap >= len(bank) + 2 and p_cap == 30  # the next add of two fits in place
    keys = [k.clone() for k in bank.keys]
    ok = torch.randint(1, 300, (28,), generator=g).tolist()
    bad = torch.randint(1, 300, (29,), generator=g).tolist()
    bad[-1] = 10_000  # runs in the second chunk (40-token budget), after the first wrote
    with pytest.raises(IndexError):
        bank.add([bad, ok])
    assert len(bank) == 6 and all(torch.equal(a, b) for a, b in zip(keys, bank.keys,
                                                                     strict=True))
    assert bank.capacity == (e_cap, p_cap)  # it ran in place
    assert bank._kbuf[0][7, :, 20:28].abs().sum() > 0  # the failed add's states are there
    short = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (3, 5)]
    assert bank.add(short) == [6, 7]
    _assert_bank_equals_plain_forwards(model, bank, prefixes + short)


# --------------------------------------------------------------------------- sliding-window models


def _mistral(window):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, vocab_size=300,
                        sliding_window=window, max_position_embeddings=512)
    cfg._attn_implementation = "sdpa"
    return MistralForCausalLM(cfg).eval()


def _suffix_errors(model, layers=None, cascade=False):
    """Largest difference between the bank's suffix states (KV-copy path, or cascade) and a
    plain, unpadded forward of each row's prefix + suffix (rows with prefixes of different
    lengths, so the shorter ones carry padding inside the sequence). ``layers``: the layer
    descriptions the bank builds its masks from (None: transformers' own masks)."""
    from icqs_fast.engine.batching import PrefixBank, decoder_body, suffix_hidden

    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (17, 9, 30)]
    bank = PrefixBank(model, 0, 10_000, layers=layers)
    bank.add(prefixes)
    entries = [2, 0, 1, 0, 1]
    suffixes = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (5, 3, 7, 2, 6)]
    h, _ = suffix_hidden(model, bank, entries, suffixes, 0, cascade=cascade)
    err = 0.0
    for i, (e, s) in enumerate(zip(entries, suffixes, strict=True)):
        with torch.no_grad():
            full = decoder_body(model)(input_ids=torch.tensor([prefixes[e] + s]))
        err = max(err, float((h[i, :len(s)] - full.last_hidden_state[0, -len(s):]).abs().max()))
    return err


def test_kv_copy_path_on_a_mistral_without_window():
    """The KV-copy path on a full-attention Mistral: every row equals a plain forward of its
    prefix + suffix."""
    assert _suffix_errors(_mistral(None)) < 1e-5


def _gemma2(window):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=300, head_dim=16, sliding_window=window,
        final_logit_softcapping=None, attn_implementation="eager")).eval()


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_sliding_window_models_take_positional_masks(tokenizer, kind):
    """A sliding-window Mistral (window 4, every layer) and a hybrid sliding/global Gemma2 (one
    sliding layer, attention softcapping) are served by the prefix bank: with the layers'
    descriptions the bank builds and the suffix forwards (KV copies and cascade) take their
    masks from positions and match a plain forward; the engine says so. Negative control: with
    transformers' slot-counting masks (no descriptions) the padded layout is far off, which is
    why the bank needs the positional masks."""
    from icqs_fast import ICQSScorer
    from icqs_fast.engine.layout import layer_attention

    model = _mistral(4) if kind == "mistral" else _gemma2(4)
    layers = layer_attention(model.config)
    assert sum(la.kind == "sliding" for la in layers) == (2 if kind == "mistral" else 1)
    assert _suffix_errors(model, layers) < 1e-4
    assert _suffix_errors(model, layers, cascade=True) < 1e-4
    assert _suffix_errors(model) > 1e-2
    scorer = ICQSScorer(model, tokenizer, GOOD, BAD, **KW)
    assert scorer.plan.path == "cascade"
    assert "sliding-window masks (4 tokens" in scorer.plan.message
