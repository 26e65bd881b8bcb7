"""``stream: true`` on ``/v1/completions``: server-sent events read by the ``openai`` client
and by hand, against ``icqs-fast serve`` on 127.0.0.1 with the tiny model.

The concatenated stream equals the non-streamed answer (text, finish reason, usage, log-probs),
generation text arrives in several pieces as its tokens are chosen, a stop string's text is never
streamed, and a client that disconnects mid-stream frees its generation's slot at the next
forward.
"""

import json
import time

import httpx
import openai
import pytest
import torch
from _helpers import save_tiny_llama

from icqs_fast.serve.app import ServeConfig, Server
from icqs_fast.serve.generation import StopStrings
from icqs_fast.serve.runner import ServerThread
from icqs_fast.serve.streaming import TextDelta, held_back

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = ["The cat sat on the", "Once upon a time", "1, 2, 3,"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = save_tiny_llama(tmp_path_factory.mktemp("tiny_stream"), layers=2)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return str(d), model, AutoTokenizer.from_pretrained(d)


@pytest.fixture(scope="module")
def server(tiny):
    d, model, tok = tiny
    srv = Server(model, tok, ServeConfig(model_name="tiny"))
    with ServerThread(srv) as st:
        yield st, srv


def _client(st):
    return openai.OpenAI(base_url=st.base_url + "/v1", api_key="none", max_retries=0)


def _streamed(client, **kw):
    """Per choice index: concatenated text, finish reasons seen, chunk count; and the usage."""
    texts: dict[int, str] = {}
    finishes: dict[int, list] = {}
    pieces: dict[int, int] = {}
    usage = None
    for chunk in client.completions.create(model="tiny", stream=True, **kw):
        assert chunk.object == "text_completion"
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            pieces[c.index] = pieces.get(c.index, 0) + 1
            finishes.setdefault(c.index, []).append(c.finish_reason)
    return texts, finishes, pieces, usage


@pytest.mark.parametrize("kw", [
    {"prompt": PROMPTS[0], "max_tokens": 12},
    {"prompt": PROMPTS, "max_tokens": 8, "echo": True},
    {"prompt": PROMPTS[1], "max_tokens": 12, "stop": ["e", "the"]},
    {"prompt": [[5, 6, 7], [9, 10]], "max_tokens": 5, "logit_bias": {"100": 5.0}},
])
def test_stream_equals_plain_completion(server, kw):
    """The openai client's stream, concatenated per choice, is the non-streamed text; the
    finish reason comes once, on the last piece; usage (include_usage) is the same."""
    st, _ = server
    client = _client(st)
    plain = client.completions.create(model="tiny", **kw)
    texts, finishes, pieces, usage = _streamed(client, stream_options={"include_usage": True},
                                               **kw)
    assert sorted(texts) == [c.index for c in plain.choices]
    for c in plain.choices:
        assert texts[c.index] == c.text
        assert finishes[c.index][-1] == c.finish_reason
        assert all(f is None for f in finishes[c.index][:-1])
    assert usage is not None and usage.model_dump() == plain.usage.model_dump()
    if "stop" not in kw:  # a generation streams token by token (a stop may end it at once)
        assert max(pieces.values()) >= 3


def test_stream_scoring_is_one_chunk_with_logprobs(server):
    """Echo / log-probs only (max_tokens=0) and max_tokens=1 with log-probs: one chunk per
    choice, the same log-probs as the plain answer, then [DONE]."""
    st, _ = server
    for body in ({"prompt": PROMPTS, "max_tokens": 0, "echo": True, "logprobs": 2},
                 {"prompt": PROMPTS[2], "max_tokens": 1, "echo": True, "logprobs": 1},
                 {"prompt": PROMPTS[0], "max_tokens": 4, "logprobs": 1}):
        plain = httpx.post(st.base_url + "/v1/completions", json=body, timeout=60).json()
        with httpx.stream("POST", st.base_url + "/v1/completions",
                          json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [ln for ln in r.iter_lines() if ln]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
        assert len(chunks) == len(plain["choices"])
        for chunk, want in zip(chunks, plain["choices"], strict=True):
            (got,) = chunk["choices"]
            assert got == want


def test_stream_options_without_stream_is_refused(server):
    st, _ = server
    r = httpx.post(st.base_url + "/v1/completions", timeout=30,
                   json={"prompt": "hi", "max_tokens": 2, "stream_options":
                         {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    r = httpx.post(st.base_url + "/v1/completions", timeout=30,
                   json={"prompt": "hi", "stream": True, "stream_options": {"bogus": 1}})
    assert r.status_code == 400


def test_stream_never_sends_what_a_stop_string_removes(tiny):
    """Token by token, the sent text is always a prefix of the final (cut) text, and a tail
    that may begin a stop string waits."""
    _, _, tok = tiny
    stops = StopStrings(["lo wor", "xyz"])
    assert held_back("hello", stops) == 2
    assert held_back("hello w", stops) == 4
    assert held_back("hello wo", stops) == 5
    assert held_back("help", stops) == 0
    assert held_back("hello ", StopStrings(["o w"])) == 2
    assert held_back("hello", StopStrings(["o w"])) == 1
    assert held_back("abcx", stops) == 1
    assert held_back("abcxy", stops) == 2
    assert held_back("ab\ufffd", None) == 1
    ids = tok("hello world, hello there", add_special_tokens=False)["input_ids"]
    delta = TextDelta(tok, frozenset(), stops)
    sent = "".join(delta.add(t) for t in ids)
    full = tok.decode(ids)
    cut = full[:stops.first(full)]
    assert cut.startswith(sent) and "lo wor" not in sent
    assert sent + delta.rest(cut) == cut


def test_disconnect_mid_stream_frees_the_generation(tiny):
    """A client that reads one piece and goes away: its generation is dropped at the next
    forward (counted as cancelled, no live generation left), and the server answers the next
    request."""
    d, model, tok = tiny
    srv = Server(model, tok, ServeConfig(model_name="tiny", max_gen_tokens=400))
    forwards = []

    def slow(_m, _a):
        forwards.append(time.monotonic())
        time.sleep(0.05)

    hook = model.get_input_embeddings().register_forward_pre_hook(slow)
    try:
        with ServerThread(srv) as st:
            with httpx.stream("POST", st.base_url + "/v1/completions", timeout=60,
                              json={"prompt": "a b c", "max_tokens": 400, "stream": True}) as r:
                it = r.iter_lines()
                first = next(ln for ln in it if ln)
                assert first.startswith("data: {")
                assert srv.queue.live_steps == 1
            t0 = time.monotonic()
            while (srv.queue.live_steps or srv.queue.cancelled == 0) and \
                    time.monotonic() - t0 < 10:
                time.sleep(0.02)
            assert srv.queue.live_steps == 0 and srv.queue.cancelled == 1
            n = len(forwards)
            assert n < 100  # far from the 400 tokens asked
            time.sleep(0.3)
            assert len(forwards) == n  # nothing runs for it any more
            r = httpx.post(st.base_url + "/v1/completions", timeout=60,
                           json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200
    finally:
        hook.remove()


def test_deadline_mid_stream_is_an_error_event(tiny):
    """A generation that outlives --request-timeout after its stream started: the pieces so
    far, then one error event (deadline_exceeded) and no [DONE]; its work is stopped."""
    d, model, tok = tiny
    # 400 tokens at >= 0.05 s a forward outlast the 3 s deadline many times over, and 3 s is
    # ample for a loaded machine to start the stream (0.6 s was not always).
    srv = Server(model, tok, ServeConfig(model_name="tiny", max_gen_tokens=400,
                                         request_timeout=3.0))
    hook = model.get_input_embeddings().register_forward_pre_hook(
        lambda _m, _a: time.sleep(0.05))
    try:
        with ServerThread(srv) as st:
            with httpx.stream("POST", st.base_url + "/v1/completions", timeout=60,
                              json={"prompt": "a b c", "max_tokens": 400, "stream": True}) as r:
                assert r.status_code == 200
                lines = [ln for ln in r.iter_lines() if ln]
            t0 = time.monotonic()  # the running step ends at its next forward
            while srv.queue.live_steps and time.monotonic() - t0 < 10:
                time.sleep(0.02)
            assert srv.queue.timed_out == 1 and srv.queue.live_steps == 0
    finally:
        hook.remove()
    assert "data: [DONE]" not in lines and len(lines) >= 2
    err = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert err["code"] == "deadline_exceeded"
    assert all("choices" in json.loads(ln.removeprefix("data: ")) for ln in lines[:-1])
