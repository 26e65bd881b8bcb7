"""The precision benchmark's rounding study (:func:`bench.studies.precision.rounding_study`):
what "plan B" rounds (the input activations of the named linears, once, to bf16), that the hooks
go away after, and that the study reads the echo path the batch-invariance promise is about."""

from __future__ import annotations

import pytest
import torch

from bench.studies import precision
from icqs_fast import models

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    d = tiny_llama_dir(layers=2)
    fp32, tok = models.load_model(d, dtype="float32", device="cpu")
    mixed, _ = models.load_model(d, dtype="bf16-mixed", device="cpu")
    ids = tok("Review: the film was a quiet, patient study of grief and friendship. " * 3)[
        "input_ids"]
    other = tok("The quick brown fox jumps over the lazy dog. " * 4)["input_ids"]
    passage = (ids, [other[:5], ids[:9] + other[:7], ids, other, ids[:20]])
    return fp32, mixed, tok, passage


def test_rounded_inputs_round_only_the_named_linears(tiny):
    _, mixed, _, _ = tiny
    seen = {}
    ids = torch.tensor([[1, 5, 9, 13]])
    with precision.rounded_inputs(mixed, ("v_proj",)) as n:
        # Registered after the study's hooks, so they see what each linear receives.
        hooks = [m.register_forward_pre_hook(lambda m, a, n=n: seen.__setitem__(n, a[0].clone()))
                 for n, m in mixed.named_modules() if isinstance(m, torch.nn.Linear)]
        try:
            with torch.no_grad():
                mixed(input_ids=ids)
        finally:
            for h in hooks:
                h.remove()
    assert n == 2  # one v_proj per layer
    for name, x in seen.items():
        if name.endswith("v_proj"):
            assert torch.equal(x, x.bfloat16().float()), name
        elif name.endswith(("q_proj", "gate_proj")):
            assert not torch.equal(x, x.bfloat16().float()), name
    assert not any(m._forward_pre_hooks for m in mixed.modules()
                   if isinstance(m, torch.nn.Linear))


def test_study_rows(tiny):
    fp32, mixed, tok, passage = tiny
    base = precision.echo_logprobs(mixed, tok, passage)[0]
    rows = precision.rounding_study(
        fp32, mixed, tok, rows=(("none", ()), ("all", precision.LINEARS)), passage=passage)
    none, every = rows
    assert none["linears"] == 0 and every["linears"] == 2 * len(precision.LINEARS)
    # bf16-mixed as it is: batch-invariant at fp32's level; rounding every input moves the
    # passage against float32 further than the weights alone do.
    assert none["echo_alone_vs_request_max_per_token"] <= 1e-4
    assert every["echo_vs_fp32_max_per_token"] > none["echo_vs_fp32_max_per_token"]
    # The study leaves the model as it was (the same numbers as before it ran).
    again = precision.echo_logprobs(mixed, tok, passage)[0]
    assert torch.equal(again, base)
