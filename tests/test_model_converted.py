"""The GGUF's float32 conversion (kvsim.model.converted): exact, reused, rewritten when stale
or damaged, and optional (an unwritable cache only costs time)."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from kvsim.model import converted


@pytest.fixture(scope="module")
def gguf_copy(tmp_path_factory):
    """A copy of the fetched SmolLM2 GGUF in a directory of its own (the conversions these
    tests write and break stay out of the shared model cache)."""
    from kvsim.model.fetch import cached_gguf_path
    from kvsim.model.presets import load_model_preset

    src = cached_gguf_path(load_model_preset("smollm2-135m"))
    if not src.is_file():
        pytest.fail("SmolLM2-135M weights missing: run `kvsim model fetch` first")
    path = tmp_path_factory.mktemp("gguf") / src.name
    shutil.copyfile(src, path)
    return path


@pytest.fixture(scope="module")
def ref(gguf_copy):
    """The model and tokenizer straight from the GGUF (no conversion involved)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_copy.parent), gguf_file=gguf_copy.name,
                                        local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_copy.parent),
                                                 gguf_file=gguf_copy.name,
                                                 dtype=torch.float32, local_files_only=True,
                                                 attn_implementation="sdpa")
    return model.eval(), tok


TEXT = "def f(x):\n    return x ** 2  # naïve 你好 <|im_start|>user\nHello!<|im_end|>"


def _same(ref_model, ref_tok, lm) -> None:
    ref, got = ref_model.state_dict(), lm.model.state_dict()
    assert set(ref) == set(got)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    ids = ref_tok(TEXT).input_ids
    assert lm.tokenizer(TEXT).input_ids == ids
    assert (lm.tokenizer.bos_token, lm.tokenizer.eos_token, lm.tokenizer.pad_token) == \
        (ref_tok.bos_token, ref_tok.eos_token, ref_tok.pad_token)
    assert lm.tokenizer.chat_template == ref_tok.chat_template
    with torch.no_grad():
        x = torch.tensor([ids])
        assert torch.equal(ref_model(x).logits, lm.model(x).logits)
    # tied embeddings stay tied
    assert lm.model.lm_head.weight.data_ptr() == lm.model.model.embed_tokens.weight.data_ptr()


@pytest.mark.slow
def test_the_conversion_is_exact_reused_and_rewritten_when_damaged(gguf_copy, ref, capsys):
    from kvsim.core.data_files import sha256_file
    from kvsim.model.load import load_lm

    ref_model, ref_tok = ref
    sha = sha256_file(gguf_copy)
    target = converted.converted_dir(gguf_copy, sha)
    assert not target.exists()
    first = load_lm(str(gguf_copy), threads=1)  # from the GGUF, then converted
    assert first.meta["converted"] == str(target) and converted.usable(target, sha)
    marker = json.loads((target / converted.MARKER).read_text())
    assert marker["gguf_sha256"] == sha and marker["gguf_file"] == gguf_copy.name
    assert marker["weights_sha256"] == sha256_file(target / converted.WEIGHTS)
    assert "quantization_config" not in json.loads((target / "config.json").read_text())
    _same(ref_model, ref_tok, first)
    # only the conversion and the GGUF are there: no temporary directory left behind
    assert sorted(p.name for p in gguf_copy.parent.iterdir()) == \
        sorted([gguf_copy.name, target.name])

    # from the conversion: transformers' GGUF reader is not used at all
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    def no_gguf(*a, **kw):
        raise AssertionError("the GGUF was read again")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_utils, "load_gguf_checkpoint", no_gguf)
        again = load_lm(str(gguf_copy), threads=1)
        with pytest.raises(AssertionError, match="read again"):  # the patch does bite
            load_lm(str(gguf_copy), dtype="bfloat16", threads=1)
    _same(ref_model, ref_tok, again)
    assert again.meta["converted"] == str(target)
    # bfloat16: from the GGUF (some architectures dequantize straight into it), not converted
    bf16 = load_lm(str(gguf_copy), dtype="bfloat16", threads=1)
    assert "converted" not in bf16.meta
    ref_bf16 = {k: v.to(torch.bfloat16) for k, v in ref_model.state_dict().items()}
    assert all(torch.equal(ref_bf16[k], v) for k, v in bf16.model.state_dict().items())

    # a weights file of another size (truncated): not used (load_lm loads the GGUF and
    # writes again, which replaces it: as here)
    weights = target / converted.WEIGHTS
    weights.write_bytes(weights.read_bytes()[:1000])
    assert not converted.usable(target, sha)
    assert converted.write(ref_model, ref_tok, gguf_copy, sha) == target
    assert converted.usable(target, sha)
    # damaged weights of the right size behind a valid marker (a garbled header): a note,
    # the GGUF again, a fresh conversion
    with open(weights, "r+b") as f:
        f.write(b"\xff" * 16)
    assert converted.usable(target, sha)
    healed = load_lm(str(gguf_copy), threads=1)
    assert "did not load" in capsys.readouterr().err
    _same(ref_model, ref_tok, healed)
    _same(ref_model, ref_tok, load_lm(str(gguf_copy), threads=1))  # the new conversion
    assert "did not load" not in capsys.readouterr().err


@pytest.mark.slow
def test_writes_unwritable_stale_and_concurrent(gguf_copy, ref, monkeypatch, capsys):
    """The conversion cannot be written: a note on stderr, None, and nothing left behind;
    a concurrent writer's finished conversion is taken as it is, found before or at the
    rename; a stale one (another transformers version) is replaced; killed writers'
    leftovers are removed."""
    import tempfile

    from kvsim.core.data_files import sha256_file

    model, tok = ref
    sha = sha256_file(gguf_copy)
    before = sorted(p.name for p in gguf_copy.parent.iterdir())

    def refuse(*a, **kw):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    assert converted.write(model, tok, gguf_copy, "f" * 64) is None
    assert "could not write the converted model" in capsys.readouterr().err
    monkeypatch.undo()
    assert sorted(p.name for p in gguf_copy.parent.iterdir()) == before
    # a writer that finds a complete conversion (another process's) keeps it
    target = converted.write(model, tok, gguf_copy, sha)
    assert target is not None and converted.usable(target, sha)
    stamp = (target / converted.MARKER).stat().st_mtime_ns
    assert converted.write(model, tok, gguf_copy, sha) == target
    assert (target / converted.MARKER).stat().st_mtime_ns == stamp
    doc = json.loads((target / converted.MARKER).read_text())
    (target / converted.MARKER).write_text(json.dumps({**doc, "transformers_version": "0.0"}))
    assert not converted.usable(target, sha)
    assert converted.write(model, tok, gguf_copy, sha) == target
    assert converted.usable(target, sha)
    assert {p.name for p in gguf_copy.parent.iterdir()} == {*before, target.name}
    # weights that are not all float32: not converted, a note
    capsys.readouterr()
    assert converted.write(copy.deepcopy(model).to(torch.bfloat16), tok, gguf_copy, sha) is None
    assert "not all float32" in capsys.readouterr().err

    # another writer renames its conversion into place between this one's check and its
    # rename: this one's rename fails, it keeps the other's and drops its own
    other = gguf_copy.parent.parent / "other-writer"
    target.rename(other)
    other_stamp = (other / converted.MARKER).stat().st_mtime_ns
    real_rename = Path.rename
    raced = []

    def racing_rename(self, dest):
        if Path(dest) == target and not raced:
            raced.append(self)
            real_rename(other, target)
        return real_rename(self, dest)

    monkeypatch.setattr(Path, "rename", racing_rename)
    assert converted.write(model, tok, gguf_copy, sha) == target
    monkeypatch.undo()
    assert raced and converted.usable(target, sha)
    assert (target / converted.MARKER).stat().st_mtime_ns == other_stamp  # the other's
    assert {p.name for p in gguf_copy.parent.iterdir()} == {*before, target.name}

    # leftovers of writers that were killed (no cleanup) go; a live writer's stay
    dead = gguf_copy.parent / f".{target.name}.tmp-4194303-abc"
    live = gguf_copy.parent / f".{target.name}.tmp-{os.getpid()}-xyz"
    aside = gguf_copy.parent / f".{target.name}.trash-4194302"
    for d in (dead, live, aside):
        d.mkdir()
    converted.write(model, tok, gguf_copy, sha)
    assert live.exists() and not dead.exists() and not aside.exists()
    live.rmdir()


def test_usable_needs_the_marker_the_sha_the_size_and_this_transformers(tmp_path):
    import transformers

    assert not converted.usable(tmp_path, "a" * 64)  # nothing there
    (tmp_path / converted.WEIGHTS).write_bytes(b"x")
    (tmp_path / "config.json").write_text("{}")
    doc = {"format": converted.FORMAT, "gguf_sha256": "a" * 64, "weights_bytes": 1,
           "transformers_version": transformers.__version__}
    (tmp_path / converted.MARKER).write_text(json.dumps(doc))
    assert converted.usable(tmp_path, "a" * 64)
    assert not converted.usable(tmp_path, "b" * 64)
    (tmp_path / converted.MARKER).write_text("{not json")
    assert not converted.usable(tmp_path, "a" * 64)
    (tmp_path / converted.MARKER).write_text(json.dumps({**doc, "format": 0}))
    assert not converted.usable(tmp_path, "a" * 64)
    (tmp_path / converted.MARKER).write_text(json.dumps({**doc, "weights_bytes": 2}))
    assert not converted.usable(tmp_path, "a" * 64)  # the weights file has another size
    assert converted.converted_dir(tmp_path / "m.Q4.gguf", "0123456789abcdef" * 4).name == \
        "m.Q4.hf-0123456789abcdef"
