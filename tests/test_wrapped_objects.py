"""A wrapped model as an object: it pickles, ``torch.save``s and ``save_pretrained``s as the
unwrapped model would, and deep-copies as a wrapped model that :func:`autoremat.remove` cleans.

Every check that trains compares loss and gradients with the unwrapped model (same seed, dropout
on), through ``conftest.assert_same_step``.
"""

from __future__ import annotations

import copy
import io
import json
import pickle
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from autoremat import wrap
from autoremat.core import huggingface
from autoremat.core.classes import Hook, is_wrapped
from conftest import assert_same_step

ENTRIES = ["inp", "blocks[0:2]", "blocks[3:5]", "out"]
SELECTIVE = {"inp": ("aten.addmm",)}


def _net() -> nn.Sequential:
    """A plain Sequential (importable anywhere) with dropout, a nested Sequential for runs."""
    torch.manual_seed(0)
    blocks = nn.Sequential(
        nn.Linear(16, 16),
        nn.GELU(),
        nn.Dropout(0.2),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
    )
    return nn.Sequential(
        OrderedDict(inp=nn.Linear(8, 16), drop=nn.Dropout(0.2), blocks=blocks, out=nn.Linear(16, 4))
    )


def _wrapped_net() -> tuple[nn.Sequential, nn.Sequential, tuple[Any, ...]]:
    """(unwrapped reference, the same model wrapped with runs and a selective entry, args)."""
    reference = _net()
    model = wrap.apply(copy.deepcopy(reference), ENTRIES, selective=SELECTIVE)
    assert is_wrapped(model.inp) and is_wrapped(model.blocks)
    return reference, model, (torch.randn(4, 8),)


def _assert_plain(model: nn.Module) -> None:
    """Nothing of autoremat is left on ``model``: its own classes, no autoremat attribute,
    method or hook."""
    assert wrap.wrapped_paths(model) == ()
    for name, m in model.named_modules():
        assert not is_wrapped(m), name
        assert type(m).__module__.split(".")[0] in ("torch", "transformers"), (name, type(m))
        assert not [k for k in m.__dict__ if k.startswith("_autoremat")], name
        assert "__reduce_ex__" not in m.__dict__ and "__deepcopy__" not in m.__dict__, name
        hooks = list(m._forward_pre_hooks.values())
        assert not [h for h in hooks if isinstance(h, Hook)], name
        assert set(m._forward_pre_hooks_with_kwargs) <= set(m._forward_pre_hooks), name


def _assert_same_wrap(copied: nn.Module, model: nn.Module) -> None:
    assert wrap.wrapped_paths(copied) == wrap.wrapped_paths(model)
    assert wrap.selective_paths(copied) == wrap.selective_paths(model)
    for (name, a), (_, b) in zip(copied.named_modules(), model.named_modules(), strict=True):
        assert type(a) is type(b), name


def test_state_dict_keys_and_loading_are_those_of_the_unwrapped_model(tmp_path):
    reference, model, args = _wrapped_net()
    assert list(model.state_dict()) == list(reference.state_dict())
    torch.save(model.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert list(state) == list(reference.state_dict())
    fresh = _net()
    for p in fresh.parameters():
        nn.init.zeros_(p)
    fresh.load_state_dict(state)  # wrapped -> unwrapped
    wrap.apply(fresh, ENTRIES, selective=SELECTIVE)
    fresh.load_state_dict(reference.state_dict())  # unwrapped -> wrapped
    assert_same_step(reference, fresh, args, {})


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_gives_the_unwrapped_model_at_every_protocol(protocol):
    reference, model, args = _wrapped_net()
    data = pickle.dumps(model, protocol=protocol)
    assert b"autoremat" not in data and b"Checkpointed" not in data
    loaded = pickle.loads(data)
    _assert_plain(loaded)
    assert [type(m) for m in loaded.modules()] == [type(m) for m in reference.modules()]
    assert list(loaded.state_dict()) == list(reference.state_dict())
    # the original is still wrapped and trains as the unwrapped model, and so does the copy
    assert set(wrap.wrapped_paths(model)) == set(ENTRIES)
    assert wrap.selective_paths(model) == SELECTIVE
    assert_same_step(reference, model, args, {})
    assert_same_step(reference, loaded, args, {})


def test_a_wrapped_submodule_pickles_as_its_own_class():
    _, model, _ = _wrapped_net()
    assert type(pickle.loads(pickle.dumps(model.inp))) is nn.Linear
    assert type(pickle.loads(pickle.dumps(model.blocks))) is nn.Sequential


def test_torch_save_and_load_give_the_unwrapped_model_that_trains_the_same(tmp_path):
    reference, model, args = _wrapped_net()
    torch.save(model, tmp_path / "model.pt")
    assert b"autoremat" not in (tmp_path / "model.pt").read_bytes()
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    _assert_plain(loaded)
    assert_same_step(reference, loaded, args, {})
    assert_same_step(reference, model, args, {})


def test_deepcopy_is_wrapped_trains_the_same_and_remove_cleans_the_copy_only():
    reference, model, args = _wrapped_net()
    copied = copy.deepcopy(model)
    _assert_same_wrap(copied, model)
    assert not set(map(id, copied.parameters())) & set(map(id, model.parameters()))
    assert_same_step(copy.deepcopy(reference), copied, args, {})
    assert wrap.remove(copied) is copied
    _assert_plain(copied)
    assert_same_step(reference, copied, args, {})
    assert set(wrap.wrapped_paths(model)) == set(ENTRIES)  # the original stays wrapped
    assert_same_step(reference, model, args, {})


def test_shallow_copy_of_a_wrapped_module_stays_wrapped():
    _, model, _ = _wrapped_net()
    copied = copy.copy(model.inp)
    assert type(copied) is type(model.inp)
    assert wrap.selective_paths(nn.Sequential(OrderedDict(inp=copied))) == SELECTIVE
    assert copied.weight is model.inp.weight


@pytest.mark.slow
def test_the_pickle_loads_where_autoremat_was_never_imported(tmp_path):
    """A fresh interpreter that imports torch only (and transformers, for the GPT-2 pickle)
    loads the pickles and gets the plain models; autoremat stays unimported."""
    _, model, _ = _wrapped_net()
    torch.save(model, tmp_path / "net.pt")
    (tmp_path / "net.pkl").write_bytes(pickle.dumps(model))
    names = ["net.pt", "net.pkl"]
    if _transformers_or_none() is not None:
        gpt2 = wrap.apply(_gpt2(), ["transformer.h.0", "transformer.h.1"])
        torch.save(gpt2, tmp_path / "gpt2.pt")
        names.append("gpt2.pt")
    script = textwrap.dedent(
        f"""
        import pickle, sys, torch
        from pathlib import Path
        folder = Path({str(tmp_path)!r})
        for name in {names!r}:
            if name.endswith(".pkl"):
                m = pickle.loads((folder / name).read_bytes())
            else:
                m = torch.load(folder / name, weights_only=False)
            for sub in m.modules():
                assert type(sub).__module__.split(".")[0] in ("torch", "transformers"), type(sub)
                assert not [k for k in vars(sub) if "autoremat" in k or k == "__reduce_ex__"]
                assert not sub._forward_pre_hooks, sub._forward_pre_hooks
        assert not [k for k in sys.modules if k.startswith("autoremat")]
        print("plain", len({names!r}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"plain {len(names)}"


# Hugging Face


def _transformers_or_none() -> Any:
    try:
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    return transformers


def _gpt2() -> nn.Module:
    t = pytest.importorskip("transformers")
    t.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = t.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        n_positions=16,
        vocab_size=50,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = t.GPT2LMHeadModel(config)
    model.train()
    return model


def _gpt2_inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def _caches(model: nn.Module) -> bool:
    """Whether ``model``, training, returns a key/value cache when asked for one."""
    with torch.enable_grad():
        out = model(input_ids=_gpt2_inputs()["input_ids"], use_cache=True)
    return out.past_key_values is not None


GPT2_ENTRIES = ["transformer.h.0", "transformer.h.1"]


def test_gpt2_state_dict_keys_unchanged():
    reference = _gpt2()
    model = wrap.apply(copy.deepcopy(reference), GPT2_ENTRIES)
    assert list(model.state_dict()) == list(reference.state_dict())


def test_gpt2_pickle_drops_the_wrap_and_the_use_cache_hook():
    reference = _gpt2()
    model = wrap.apply(copy.deepcopy(reference), GPT2_ENTRIES, selective=["transformer.h.1"])
    assert not _caches(model)  # the hook forces use_cache=False in training
    buffer = io.BytesIO()
    torch.save(model, buffer)
    assert b"autoremat" not in buffer.getvalue()
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    _assert_plain(loaded)
    assert type(loaded) is type(reference)
    assert _caches(loaded)  # no hook: the plain model's cache
    assert not _caches(model)  # the original keeps its hook
    assert_same_step(reference, loaded, (), _gpt2_inputs())
    assert_same_step(reference, model, (), _gpt2_inputs())


def test_gpt2_deepcopy_is_wrapped_and_hooked_and_remove_cleans_the_copy():
    """The copy carries a copy of the use_cache hook; ``remove`` finds it on the copy (before:
    it looked the hook up by the original's handle, and left it on the copy, which then ignored
    ``use_cache=True`` in training)."""
    reference = _gpt2()
    model = wrap.apply(copy.deepcopy(reference), GPT2_ENTRIES, selective=["transformer.h.1"])
    copied = copy.deepcopy(model)
    _assert_same_wrap(copied, model)
    assert not _caches(copied)
    huggingface.turn_cache_off_in_training(copied)  # no second hook on a copied one
    assert sum(isinstance(h, Hook) for h in copied._forward_pre_hooks.values()) == 1
    assert_same_step(copy.deepcopy(reference), copied, (), _gpt2_inputs())
    wrap.remove(copied)
    _assert_plain(copied)
    assert _caches(copied)
    assert_same_step(reference, copied, (), _gpt2_inputs())
    assert wrap.wrapped_paths(model) == tuple(GPT2_ENTRIES) and not _caches(model)
    assert_same_step(reference, model, (), _gpt2_inputs())


@pytest.mark.parametrize("entries", [[""], GPT2_ENTRIES], ids=["root", "blocks"])
def test_gpt2_save_pretrained_names_the_original_architecture(tmp_path, entries):
    t = pytest.importorskip("transformers")
    reference = _gpt2()
    model = wrap.apply(copy.deepcopy(reference), entries)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"]
    # the model is still wrapped, and says so
    assert wrap.wrapped_paths(model) == tuple(entries)
    if entries == [""]:
        assert type(model).__name__ == "CheckpointedGPT2LMHeadModel"
        assert repr(model).startswith("CheckpointedGPT2LMHeadModel(")
    loaded = t.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is t.GPT2LMHeadModel
    loaded.train()
    assert_same_step(reference, loaded, (), _gpt2_inputs())
    assert_same_step(reference, model, (), _gpt2_inputs())


def test_gpt2_save_pretrained_that_raises_leaves_the_model_wrapped(tmp_path, monkeypatch):
    t = pytest.importorskip("transformers")
    model = wrap.apply(_gpt2(), [""])
    wrapped_class = type(model)
    seen = []

    def failing(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        seen.append(type(self))
        raise OSError("disk full")

    monkeypatch.setattr(t.GPT2LMHeadModel, "save_pretrained", failing)
    with pytest.raises(OSError, match="disk full"):
        model.save_pretrained(Path(tmp_path))
    assert seen == [t.GPT2LMHeadModel]
    assert type(model) is wrapped_class
    assert not hasattr(wrap.apply(nn.Sequential(nn.Linear(2, 2)), ["0"])[0], "save_pretrained")
