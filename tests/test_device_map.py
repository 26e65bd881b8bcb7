"""--device-map {none,auto} (issue 49, item 9): a model larger than one GPU, its layers spread
by transformers' ``device_map="auto"``. Declared once, on score, features, check, serve, eval
and lm-eval's model args, in the resume fingerprint only when set; without CUDA a clear exit-2
message naming CUDA; ``load_model`` passes it and does not move the model after. The engine's
per-layer tensors (the prefix bank's index, the cascade plan's, its masks, the positional
plan's positions) follow each layer's device: checked with a fake two-device layout (layer 1
of the bank on ``meta``) and an ``index_select`` that refuses an index on another device, as
CUDA does."""

import io
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
from _helpers import write_jsonl

from icqs_fast import models
from icqs_fast.cli import main
from icqs_fast.engine.batching import PrefixBank
from icqs_fast.engine.cascade import CascadePlan, PositionPlan
from icqs_fast.engine.layout import LayerAttention
from icqs_fast.models import device_map_kwargs
from icqs_fast.options import DEVICE_MAPS


def _help(cmd: list[str]) -> str:
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        main([*cmd, "--help"])
    return out.getvalue()


@pytest.mark.parametrize("cmd", [["score"], ["features"], ["check"], ["serve"], ["eval", "fpb"]])
def test_the_flag_is_listed(cmd):
    assert "--device-map {none,auto}" in _help(cmd)


def _run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stderr(err):
        rc = main(argv)
    return rc, err.getvalue()


def _files(tmp_path):
    demos = [{"x": f"text {i}", "y": "positive" if i % 2 else "negative"} for i in range(8)]
    g, b = write_jsonl(tmp_path / "g.jsonl", demos), write_jsonl(tmp_path / "b.jsonl", demos)
    return write_jsonl(tmp_path / "in.jsonl", demos), g, b


def _commands(tmp_path, out) -> list[list[str]]:
    inp, g, b = _files(tmp_path)
    return [["score", str(inp), "-o", str(out), "--good", str(g), "--bad", str(b)],
            ["features", str(inp), "-o", str(out)],
            ["check", "--good", str(g), "--bad", str(b)],
            ["serve"], ["eval", "fpb"]]


def test_without_cuda_the_flag_exits_2_naming_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "o.jsonl"
    for argv in _commands(tmp_path, out):
        rc, err = _run([*argv, "--device-map", "auto"])
        assert rc == 2, (argv, err)
        assert "--device-map auto spreads the model over CUDA GPUs" in err, (argv, err)
        assert "Traceback" not in err
    assert not out.exists()  # refused before any output is touched


def test_load_model_refuses_without_cuda(tmp_path, monkeypatch):
    """Before any file is read (the folder does not even exist)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device-map auto spreads the model over CUDA"):
        models.load_model(tmp_path / "none", device_map="auto")
    with pytest.raises(ValueError, match="device_map must be one of none, auto"):
        models.load_model(tmp_path / "none", device="cuda", device_map="balanced")


def test_the_flag_reaches_load_model_from_every_command(tmp_path, monkeypatch):
    """Each command's load_model call carries device_map="auto" (the CUDA check passed as a
    GPU host would; the fake load stops the run at once)."""
    monkeypatch.setattr(models, "check_device_map", lambda *a, **k: None)
    seen: list[dict] = []

    def fake(*args, **kwargs):
        seen.append(kwargs)
        raise ValueError("stopped by the test")

    monkeypatch.setattr(models, "load_model", fake)
    out = tmp_path / "o.jsonl"
    for argv in _commands(tmp_path, out):
        seen.clear()
        rc, err = _run([*argv, "--device-map", "auto", "--device", "cpu"]
                       if argv[0] != "eval" else [*argv, "--device-map", "auto"])
        assert seen, (argv, rc, err)
        assert seen[-1].get("device_map") == "auto", (argv, seen)
        seen.clear()
        _run(argv if argv[0] == "eval" else [*argv, "--device", "cpu"])
        assert seen and "device_map" not in seen[-1], (argv, seen)  # none: not passed


def test_lm_eval_model_args_take_it(monkeypatch):
    pytest.importorskip("lm_eval")
    from icqs_fast.compat.lm_eval import ICQSFastLM

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device-map auto spreads the model over CUDA"):
        ICQSFastLM(pretrained="embedded", device_map="auto", device="cpu")
    seen = {}

    def fake(*args, **kwargs):
        seen.update(kwargs)
        raise ValueError("stopped by the test")

    monkeypatch.setattr(models, "check_device_map", lambda *a, **k: None)
    monkeypatch.setattr(models, "load_model", fake)
    with pytest.raises(ValueError, match="stopped by the test"):
        ICQSFastLM(pretrained="embedded", device_map="auto", device="cpu")
    assert seen["device_map"] == "auto"


def test_names_and_kwargs(monkeypatch):
    assert DEVICE_MAPS == ("none", "auto")
    assert device_map_kwargs("none", "cpu") == {}
    assert device_map_kwargs("auto", "cuda") == {"device_map": "auto"}
    with pytest.raises(ValueError, match="must be one of none, auto"):
        device_map_kwargs("sequential", "cuda")
    with pytest.raises(ValueError, match="CUDA"):
        device_map_kwargs("auto", "cpu")


def test_it_is_in_the_fingerprint_only_when_set(tmp_path):
    from icqs_fast.jobs.config import FeatureJobConfig, ScoreJobConfig
    from icqs_fast.options import declaration

    g = write_jsonl(tmp_path / "g.jsonl", [{"x": "a", "y": "b"}])
    kw = dict(input="-", output="o.jsonl", good=str(g), bad=str(g))
    plain = ScoreJobConfig(**kw).resume_key()
    split = ScoreJobConfig(**kw, device_map="auto").resume_key()
    assert "device_map" not in plain and split == {**plain, "device_map": "auto"}
    f = FeatureJobConfig(input="-", output="o.jsonl", device_map="auto").resume_key()
    assert f["device_map"] == "auto"
    assert "device_map" not in FeatureJobConfig(input="-", output="o.jsonl").resume_key()
    with pytest.raises(ValueError, match="--device-map must be one of"):
        ScoreJobConfig(**kw, device_map="balanced")
    assert declaration(ScoreJobConfig, "device_map").flag == "--device-map"


def test_load_model_passes_device_map_and_does_not_move_the_model(tiny_llama_dir, monkeypatch):
    """With the CUDA check passed, transformers gets ``device_map="auto"`` (accelerate places
    the layers: here all on the CPU, the only device) and load_model moves nothing after
    (without the flag it moves the model to ``device``: the spy sees that)."""
    pytest.importorskip("accelerate")
    import transformers

    seen = {}
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(path, **kw):
        seen.update(kw)
        return real(path, **kw)

    moved = []
    real_to = torch.nn.Module.to

    def to(self, *args, **kwargs):
        moved.append(args)
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    monkeypatch.setattr(models, "check_device_map", lambda *a, **k: None)
    monkeypatch.setattr(torch.nn.Module, "to", to)
    model, _ = models.load_model(tiny_llama_dir(), dtype="float32", device="cpu",
                                 device_map="auto")
    assert seen["device_map"] == "auto"
    assert not [a for a in moved if a and str(a[0]) == "cpu"]  # no model.to(device)
    assert next(model.parameters()).device.type == "cpu"
    seen.clear()
    models.load_model(tiny_llama_dir(), dtype="float32", device="cpu")
    assert "device_map" not in seen
    assert [a for a in moved if a and str(a[0]) == "cpu"]  # the check can fail


# ----------------------------------------------------------------- the engine on two devices


def _strict_index_select(monkeypatch):
    """``index_select`` that refuses an index on another device than its input, as CUDA
    refuses a ``cuda:0`` index into a ``cuda:1`` tensor (the CPU and ``meta`` accept it)."""
    real = torch.Tensor.index_select

    def strict(self, dim, index):
        if index.device != self.device:
            raise RuntimeError(f"index on {index.device} for a tensor on {self.device}")
        return real(self, dim, index)

    monkeypatch.setattr(torch.Tensor, "index_select", strict)


def _two_device_bank() -> PrefixBank:
    """A bank of 3 entries whose layer 0 is on the CPU and layer 1 on ``meta`` (a model split
    over two devices, as accelerate's hooks leave it)."""
    bank = PrefixBank.__new__(PrefixBank)
    shape = (3, 2, 5, 4)
    bank.keys = [torch.arange(120.0).view(shape), torch.zeros(shape, device="meta")]
    bank.values = [torch.arange(120.0).view(shape) + 1, torch.zeros(shape, device="meta")]
    bank.lengths = [5, 3, 4]
    return bank


def test_the_bank_index_is_built_on_each_layer_device(monkeypatch):
    """Before, ``gather`` built its index on layer 0's device: layer 1 (``meta`` here, a second
    GPU on a split model) got a CPU index."""
    _strict_index_select(monkeypatch)
    bank = _two_device_bank()
    kv, mask, lens = bank.gather([2, 0])
    assert [k.device.type for k, _ in kv] == ["cpu", "meta"]
    assert [v.device.type for _, v in kv] == ["cpu", "meta"]
    assert kv[1][0].shape == (2, 2, 5, 4)
    torch.testing.assert_close(kv[0][0], bank.keys[0][[2, 0]])
    torch.testing.assert_close(kv[0][1], bank.values[0][[2, 0]])
    assert lens.tolist() == [4, 5] and mask.tolist() == [[1, 1, 1, 1, 0], [1] * 5]


def test_the_cascade_plan_follows_each_layer_device(monkeypatch):
    _strict_index_select(monkeypatch)
    bank = _two_device_bank()
    plan = CascadePlan(bank.keys, bank.values, [2, 0], [0, 1], [1, 1], [4, 5])
    k0, v0 = plan.prefix_kv(0)
    k1, v1 = plan.prefix_kv(1)
    assert (k0.device.type, v0.device.type, k1.device.type, v1.device.type) == \
        ("cpu", "cpu", "meta", "meta")
    torch.testing.assert_close(k0, bank.keys[0][[2, 0]])
    cpu, meta = plan.prefix_allow(torch.device("cpu")), plan.prefix_allow(torch.device("meta"))
    assert cpu.allow.device.type == "cpu" and meta.allow.device.type == "meta"
    assert plan.prefix_key_ok(torch.device("meta")).device.type == "meta"
    assert plan.prefix_key_ok(torch.device("cpu")).tolist() == [[1, 1, 1, 1, 0], [1] * 5]


def test_a_position_plan_moves_to_a_layer_device():
    pos = torch.tensor([[2, 3]])
    plan = PositionPlan(pos, torch.tensor([[0, 1, 2, 3]]), [LayerAttention("full")])
    assert plan.on(torch.device("cpu")) is plan
    moved = plan.on(torch.device("meta"))
    assert moved.q_pos.device.type == "meta" and moved.k_pos.device.type == "meta"
    assert plan.on(torch.device("meta")) is moved  # copied once


def test_the_head_reads_states_on_its_own_device(monkeypatch):
    """The last layer and the LM head of a split model may sit on different GPUs: head_stats
    moves the states to the head's device (``meta`` here: the fused op sees one device)."""
    from icqs_fast import ops
    from icqs_fast.engine.capability import head_stats
    from icqs_fast.engine.layout import HeadEpilogue

    seen = {}

    def fake(hidden, weight, targets, **kw):
        seen.update(hidden=hidden.device, weight=weight.device, targets=targets.device)
        return None

    monkeypatch.setattr(ops, "linear_token_stats", fake)
    head = torch.nn.Linear(4, 10, bias=False, device="meta")
    head_stats(head, HeadEpilogue(), torch.zeros(3, 4), torch.tensor([1, 2, 3]), "torch")
    assert {d.type for d in seen.values()} == {"meta"}, seen


def test_the_memory_plan_counts_every_gpu_of_a_split_model(monkeypatch):
    """Each layer's bank lives on its layer's device: 3 of 4 layers on a GPU with 30 GiB free
    and 1 on one with 4 GiB allow a 16 GiB bank (4 * 4), not the first GPU's 30 GiB alone."""
    from icqs_fast.engine import memory_plan

    gib = 2**30
    free = {"cuda:0": 30 * gib, "cuda:1": 4 * gib}
    monkeypatch.setattr(memory_plan, "free_device_bytes", lambda d: free.get(str(d)))
    devs = [torch.device(d) for d in ("cuda:0", "cuda:0", "cuda:0", "cuda:1")]
    monkeypatch.setattr(memory_plan, "layer_devices", lambda model: devs)
    assert memory_plan.model_free_bytes(object()) == 16 * gib
    free["cuda:1"] = 40 * gib
    assert memory_plan.model_free_bytes(object()) == 40 * gib  # cuda:0: 30 * 4 / 3
    devs[:] = devs[:1]
    assert memory_plan.model_free_bytes(object()) == 30 * gib  # one device: its own


def test_layer_devices_reads_each_layer(tiny_llama_dir):
    from icqs_fast.engine.memory_plan import layer_devices, model_free_bytes

    model, _ = models.load_model(tiny_llama_dir(), dtype="float32", device="cpu")
    assert [d.type for d in layer_devices(model)] == ["cpu"] * model.config.num_hidden_layers
    assert model_free_bytes(model) is None  # the CPU: no free-memory reading


def test_a_ray_model_spec_carries_it(monkeypatch):
    from icqs_fast.jobs.ray_actors import ModelSpec

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device-map auto spreads the model over CUDA"):
        ModelSpec(device_map="auto").load()
    seen = {}
    monkeypatch.setattr(models, "check_device_map", lambda *a, **k: None)
    monkeypatch.setattr(models, "load_model", lambda *a, **kw: seen.update(kw))
    ModelSpec(device_map="auto", device="cuda").load()
    assert seen["device_map"] == "auto"


def _meta_hook(module, args, kwargs):
    """Moves a layer's inputs to ``meta``, as accelerate's hooks move them to a layer's GPU."""
    def mv(t):
        if isinstance(t, torch.Tensor):
            return t.to("meta")
        return tuple(mv(x) for x in t) if isinstance(t, tuple) else t

    return tuple(mv(a) for a in args), {k: mv(v) for k, v in kwargs.items()}


@pytest.mark.parametrize("cascade", [True, False])
def test_a_split_tiny_llama_runs_the_bank_and_both_suffix_paths(monkeypatch, cascade):
    """A tiny Llama with layer 0 on the CPU and layer 1 (and the final norm) on ``meta``: the
    bank's trie forward (two prefixes sharing three tokens: a continued past), its states per
    layer device, and the cascade / KV-copy suffix forwards. Before, the trie's and gather's
    index was built on the first device and the cascade plan's on layer 0's."""
    from _helpers import tiny_llama

    whole, _ = tiny_llama(device="cpu")  # seeded: the same weights as the split one
    ref = PrefixBank(whole, 0, 4096)
    ref.add([[1, 2, 3, 4, 5], [1, 2, 3, 9]])
    _strict_index_select(monkeypatch)
    model, _ = tiny_llama(device="cpu")
    body = model.model
    body.layers[1].to("meta")
    body.norm.to("meta")
    body.layers[1].register_forward_pre_hook(_meta_hook, with_kwargs=True)
    bank = PrefixBank(model, 0, 4096)
    assert bank.add([[1, 2, 3, 4, 5], [1, 2, 3, 9]]) == [0, 1]
    assert [k.device.type for k in bank.keys] == ["cpu", "meta"]
    assert [v.device.type for v in bank.values] == ["cpu", "meta"]
    # Layer 0's states (the continued past included) are those of the whole model's bank.
    torch.testing.assert_close(bank.keys[0], ref.keys[0], rtol=0, atol=0)
    torch.testing.assert_close(bank.values[0], ref.values[0], rtol=0, atol=0)
    from icqs_fast.engine.batching import suffix_hidden

    hidden, mask = suffix_hidden(model, bank, [0, 1, 1], [[7, 8], [9], [4, 4, 4]], 0,
                                 cascade=cascade)
    assert hidden.shape == (3, 3, 64) and hidden.device.type == "meta"
    assert mask.device == hidden.device and mask.shape == (3, 3)
