"""The server's echo log-probs convert the LM head weight to fp32 once per call, not once per
256-row chunk (issue 49, item 8): 0.5-2.2 GB of conversion per chunk for a 7B-sized head."""

import pytest
import torch
from _helpers import tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode

from icqs_fast.serve.logprobs import HEAD_ROWS, prompt_logprobs


class _Copies(TorchDispatchMode):
    """Counts the dtype conversions of tensors shaped like ``shape``."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.n = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == self.shape:
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.slow  # a tiny model and a 266-token prompt under a dispatch mode (~9 s here)
def test_the_head_weight_is_converted_once_per_call(monkeypatch):
    """torch's product (a GPU's path; on the CPU the packed ops.linear needs no conversion, so
    the C++ backend is switched off for the counted call)."""
    from icqs_fast import backends

    model, _ = tiny_llama(device="cpu")
    model = model.to(torch.bfloat16)
    w = model.get_output_embeddings().weight
    prompt = [int(t) for t in torch.randint(1, 1000, (HEAD_ROWS + 10,),
                                            generator=torch.Generator().manual_seed(0))]
    prompt_logprobs(model, [prompt[:8]])  # the model's plan, decided once, outside the count
    real = backends.available
    monkeypatch.setattr(backends, "available", lambda name: (False, "off") if name == "cpp"
                        else real(name))
    with _Copies(w.shape) as c:
        (out,) = prompt_logprobs(model, [prompt])
    assert c.n == 1  # was one per HEAD_ROWS chunk (2 here)
    assert len(out.token_logprobs) == len(prompt) - 1
