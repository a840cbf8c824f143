"""Offline conversion: `vllm-megamoe convert | inspect | verify` (vllm_megamoe.convert)."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from convert_checkpoints import (CONVENTIONS, build_tensors, config_for, make_checkpoint,
                                 write_checkpoint)
from vllm_megamoe import ExpertWeights, quant, transform_weights_for_mega_moe, transforms
from vllm_megamoe.cli import main as cli_main
from vllm_megamoe.convert import (check_marker_matches, convert_checkpoint, format_inspection,
                                  inspect_checkpoint, parse_size, read_megamoe_marker,
                                  verify_checkpoint)
from vllm_megamoe.convert import writer
from vllm_megamoe.convert.checkpoint import partial_dir_for
from vllm_megamoe.convert.discovery import natural_key

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCH_FORMATS = [("sm90", "fp8-block"), ("sm90", "bf16"), ("sm100", "mxfp4"), ("sm100", "bf16")]
QUIET = dict(log=lambda msg: None)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The converter runs torch ops single-threaded; so do the reference transforms here (on a
    loaded 2-core machine, 2 intra-op threads are slower than 1 on these small tensors)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """One small checkpoint per naming convention: {convention: (dir, tensors)}."""
    root = tmp_path_factory.mktemp("sources")
    return {c: (str(root / c), make_checkpoint(str(root / c), c, seed=i))
            for i, c in enumerate(CONVENTIONS)}


def load_all(root: str) -> dict:
    with open(os.path.join(root, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    out = {}
    for fn in sorted(set(weight_map.values())):
        with safe_open(os.path.join(root, fn), "pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def source_layers(convention: str, tensors: dict) -> dict:
    """{experts prefix: (w13 [E, 2I, H], w2 [E, H, I], s13, s2)} in checkpoint layout, built
    here independently of the converter's discovery."""
    layers = {}
    for name in tensors:
        if name.endswith(".experts.0.w1.weight") or name.endswith(".experts.0.gate_proj.weight"):
            prefix = name.split(".experts.0.")[0] + ".experts"
            mixtral = name.endswith("w1.weight")
            g, u, d = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            n = 1 + max(int(k[len(prefix) + 1:].split(".")[0]) for k in tensors
                        if k.startswith(prefix + "."))
            get = lambda e, p, s="": tensors.get(f"{prefix}.{e}.{p}.weight{s}")  # noqa: E731
            w13 = torch.stack([torch.cat([get(e, g), get(e, u)]) for e in range(n)])
            w2 = torch.stack([get(e, d) for e in range(n)])
            s13 = s2 = None
            if get(0, g, "_scale_inv") is not None:
                s13 = torch.stack([torch.cat([get(e, g, "_scale_inv"), get(e, u, "_scale_inv")])
                                   for e in range(n)])
                s2 = torch.stack([get(e, d, "_scale_inv") for e in range(n)])
            layers[prefix] = (w13, w2, s13, s2)
        elif name.endswith(".experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            gu, down = tensors[name], tensors[prefix + ".down_proj"]
            if convention == "stacked-transposed":
                gu, down = gu.transpose(1, 2), down.transpose(1, 2)
            layers[prefix] = (gu.contiguous(), down.contiguous(), None, None)
    return layers


def expected_layer(arch: str, fmt: str, w13, w2, s13, s2) -> dict:
    """The library transforms (quant, transforms, weights) of one whole layer."""
    fp8 = w13.dtype == quant.FP8_DTYPE
    if fp8 and not (arch == "sm90" and fmt == "fp8-block"):
        w13 = quant.dequantize_fp8_blocks(w13, s13)
        w2 = quant.dequantize_fp8_blocks(w2, s2)
    if arch == "sm90":
        ew = (ExpertWeights("fp8-block", w13, w2, s13, s2) if fp8 and fmt == "fp8-block"
              else ExpertWeights.from_float(w13, w2, fmt))
        k = transform_weights_for_mega_moe(ew, "sm90")
        out = {"w13_weight": k.w13, "w2_weight": k.w2}
        if fmt == "fp8-block":
            out.update(w13_weight_scale_inv=k.w13_scale, w2_weight_scale_inv=k.w2_scale)
        return out
    if fmt == "bf16":
        return {"w13_weight": transforms.interleave_gate_up(w13.to(torch.bfloat16)),
                "w2_weight": w2.to(torch.bfloat16)}
    q13, sf13 = quant.quantize_mxfp4(w13)
    q2, sf2 = quant.quantize_mxfp4(w2)
    return {"w13_weight": transforms.interleave_gate_up(q13), "w2_weight": q2,
            "w13_weight_scale": transforms.transpose_sf_for_utccp(transforms.interleave_gate_up(sf13)),
            "w2_weight_scale": transforms.transpose_sf_for_utccp(sf2)}


def file_digests(root: str) -> dict:
    out = {}
    for dirpath, _, files in os.walk(root):
        for fn in files:
            path = os.path.join(dirpath, fn)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


# -- conversion equals the library transforms -----------------------------------------------

@pytest.mark.parametrize("arch,fmt", ARCH_FORMATS)
@pytest.mark.parametrize("convention", CONVENTIONS)
def test_convert_equals_library_transforms(sources, tmp_path, convention, arch, fmt):
    src, tensors = sources[convention]
    dst = str(tmp_path / "out")
    # Small chunks: experts are converted a few at a time and still equal the whole-layer transform.
    result = convert_checkpoint(src, dst, arch=arch, fmt=fmt, workers=2, chunk_bytes=150_000,
                                max_shard_bytes=400_000, **QUIET)
    assert result.shards > 1
    out = load_all(dst)
    layers = source_layers(convention, tensors)
    assert layers, "test checkpoint has MoE layers"
    expert_names = set()
    for prefix, weights in layers.items():
        for name, want in expected_layer(arch, fmt, *weights).items():
            got = out[f"{prefix}.{name}"]
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert raw(got) == raw(want), f"{prefix}.{name}"
        expert_names |= {n for n in tensors if n.startswith(prefix + ".")}
    # every other tensor is carried over byte for byte, under its own name
    carried = {n: t for n, t in tensors.items() if n not in expert_names}
    converted = {n for n in out if ".experts." in n}
    assert set(out) - converted == set(carried)
    for name, t in carried.items():
        assert out[name].dtype == t.dtype and raw(out[name]) == raw(t), name
    # other files unchanged
    for rel in ("generation_config.json", "tokenizer.json", "original/params.txt"):
        with open(os.path.join(src, rel), "rb") as a, open(os.path.join(dst, rel), "rb") as b:
            assert a.read() == b.read()
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    marker = read_megamoe_marker(config)
    assert marker["arch"] == arch and marker["format"] == fmt and marker["layout_version"] == 1
    assert marker["interleave"] == 8
    assert marker["expert_modules"] == sorted(layers, key=natural_key)
    check_marker_matches(marker, arch, fmt)
    assert verify_checkpoint(dst, source=src, samples=100, **QUIET) == []
    assert not os.path.exists(partial_dir_for(dst))


def test_quantization_config_lets_vllm_create_the_right_parameters(sources, tmp_path):
    src, tensors = sources["qwen"]
    convert_checkpoint(src, str(tmp_path / "fp8"), arch="sm90", fmt="fp8-block", **QUIET)
    with open(tmp_path / "fp8" / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    assert "model.layers.0.self_attn.q_proj" in qc["ignored_layers"]
    assert not any(".experts" in m for m in qc["ignored_layers"])
    src_fp8, _ = sources["deepseek-fp8"]
    convert_checkpoint(src_fp8, str(tmp_path / "bf16"), arch="sm90", fmt="bf16", **QUIET)
    with open(tmp_path / "bf16" / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert "model.layers.1.mlp.experts" in qc["ignored_layers"]


def test_single_file_source_and_cli(tmp_path, capsys):
    src = str(tmp_path / "src")
    make_checkpoint(src, "mixtral", layers=2, shards=1)
    dst = str(tmp_path / "dst")
    assert cli_main(["convert", src, dst, "--arch", "sm90", "--format", "fp8-block", "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert cli_main(["verify", dst, "--source", src, "--samples", "4"]) == 0
    assert "verify OK" in capsys.readouterr().out
    assert cli_main(["inspect", dst]) == 0
    text = capsys.readouterr().out
    assert "MixtralForCausalLM" in text and "converted: arch sm90, format fp8-block" in text
    assert "4 per MoE layer, top-2, hidden 256, intermediate 128" in text
    assert cli_main(["inspect", src]) == 0
    assert "not converted" in capsys.readouterr().out
    # existing DST refused, --overwrite replaces it
    assert cli_main(["convert", src, dst, "--arch", "sm90", "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli_main(["convert", src, dst, "--arch", "sm100", "--overwrite", "--no-progress"]) == 0
    marker = read_megamoe_marker(json.load(open(os.path.join(dst, "config.json"))))
    assert (marker["arch"], marker["format"]) == ("sm100", "bf16")  # a BF16 source stays BF16
    # a converted checkpoint is not a source
    assert cli_main(["convert", dst, str(tmp_path / "again"), "--arch", "sm90"]) == 2
    assert "already converted" in capsys.readouterr().err


def test_output_is_deterministic(sources, tmp_path):
    src, _ = sources["deepseek-fp8"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    convert_checkpoint(src, a, arch="sm100", fmt="mxfp4", workers=1, max_shard_bytes=300_000, **QUIET)
    convert_checkpoint(src, b, arch="sm100", fmt="mxfp4", workers=3, chunk_bytes=50_000,
                       max_shard_bytes=300_000, **QUIET)
    assert file_digests(a) == file_digests(b)


def test_shards_and_checksums(sources, tmp_path):
    src, _ = sources["qwen"]
    dst = str(tmp_path / "out")
    limit = 300_000
    convert_checkpoint(src, dst, arch="sm90", max_shard_bytes=limit, **QUIET)
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and sorted(index["megamoe"]["sha256"]) == files
    for fn in files:
        with open(os.path.join(dst, fn), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == index["megamoe"]["sha256"][fn]
        with safe_open(os.path.join(dst, fn), "pt") as f:
            names = list(f.keys())
            if len(names) > 1 and not any(n.endswith("w13_weight") for n in names):
                assert os.path.getsize(os.path.join(dst, fn)) <= limit + 4096
    # one layer's experts stay together in one shard
    prefix = "model.layers.1.mlp.experts."
    assert len({fn for n, fn in index["weight_map"].items() if n.startswith(prefix)}) == 1


# -- verify ---------------------------------------------------------------------------------

def _converted(sources, tmp_path, convention="qwen", arch="sm90", fmt=None):
    src, _ = sources[convention]
    dst = str(tmp_path / "out")
    convert_checkpoint(src, dst, arch=arch, fmt=fmt, max_shard_bytes=300_000, **QUIET)
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        return src, dst, json.load(f)


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def test_verify_names_a_corrupted_shard(sources, tmp_path, capsys):
    src, dst, index = _converted(sources, tmp_path)
    bad = index["weight_map"]["model.layers.1.mlp.experts.w13_weight"]
    _flip_byte(os.path.join(dst, bad), os.path.getsize(os.path.join(dst, bad)) // 2)
    problems = verify_checkpoint(dst, **QUIET)
    assert len(problems) == 1 and bad in problems[0] and "sha256" in problems[0]
    assert cli_main(["verify", dst]) == 1
    assert bad in capsys.readouterr().err


def test_verify_with_source_names_a_changed_tensor(sources, tmp_path):
    """A tensor changed and re-hashed passes the checksum but not re-derivation."""
    src, dst, index = _converted(sources, tmp_path)
    name = "model.layers.2.mlp.experts.w2_weight"
    fn = index["weight_map"][name]
    path = os.path.join(dst, fn)
    with safe_open(path, "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    tensors[name] = tensors[name].clone()
    tensors[name].view(torch.uint8)[3, 5, 7] ^= 1  # expert 3
    save_file(tensors, path, metadata={"format": "pt"})
    with open(path, "rb") as f:
        index["megamoe"]["sha256"][fn] = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    assert verify_checkpoint(dst, **QUIET) == []
    problems = verify_checkpoint(dst, source=src, samples=1000, **QUIET)
    assert len(problems) == 1 and name in problems[0] and "expert 3" in problems[0]
    assert fn in problems[0]


def test_verify_reports_missing_shard_and_unconverted(sources, tmp_path):
    src, dst, index = _converted(sources, tmp_path)
    gone = sorted(set(index["weight_map"].values()))[-1]
    os.remove(os.path.join(dst, gone))
    problems = verify_checkpoint(dst, **QUIET)
    assert any(gone in p and "missing" in p for p in problems)
    assert "not a checkpoint written by" in verify_checkpoint(src, **QUIET)[0]


# -- failures leave no output ---------------------------------------------------------------

def test_failure_midway_leaves_nothing(sources, tmp_path, monkeypatch):
    src, _ = sources["mixtral"]
    dst = str(tmp_path / "out")
    calls = {"n": 0}
    original = writer.to_kernel_layout

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full (injected)")
        return original(*args, **kwargs)

    monkeypatch.setattr(writer, "to_kernel_layout", failing)
    with pytest.raises(OSError, match="injected"):
        convert_checkpoint(src, dst, arch="sm90", workers=2, chunk_bytes=100_000,
                           max_shard_bytes=300_000, **QUIET)
    assert not os.path.exists(dst) and not os.path.exists(partial_dir_for(dst))
    assert os.listdir(tmp_path) == []


KILL_SCRIPT = """
import sys, time
sys.path.insert(0, {repo!r})
from vllm_megamoe.convert import writer
original = writer.to_kernel_layout
def slow(*a, **k):
    time.sleep(0.15)
    return original(*a, **k)
writer.to_kernel_layout = slow
from vllm_megamoe.cli import main
sys.exit(main(["convert", {src!r}, {dst!r}, "--arch", "sm90", "--workers", "1",
               "--max-shard-size", "300000", "--no-progress"] + {extra!r}))
"""


def _start_slow_convert(src, dst, extra=()):
    script = KILL_SCRIPT.format(repo=REPO, src=src, dst=dst, extra=list(extra))
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_shard_done(partial: str, proc, timeout=30.0) -> None:
    """Wait until at least one shard is finished and another is being written."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        names = os.listdir(partial) if os.path.isdir(partial) else []
        if any(n.endswith(".safetensors") for n in names) and any(n.endswith(".partial") for n in names):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("conversion did not get going")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_conversion_leaves_no_dst_and_resumes(sources, tmp_path, sig):
    src, _ = sources["mixtral"]
    dst = str(tmp_path / "out")
    partial = partial_dir_for(dst)
    proc = _start_slow_convert(src, dst)
    _wait_for_shard_done(partial, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert not os.path.exists(dst)
    if sig == signal.SIGTERM:
        assert "--resume" in err
        assert not any(n.endswith(".partial") for n in os.listdir(partial))
    result = convert_checkpoint(src, dst, arch="sm90", max_shard_bytes=300_000, resume=True,
                                **QUIET)
    assert result.resumed_shards >= 1
    assert verify_checkpoint(dst, source=src, samples=100, **QUIET) == []
    assert not os.path.exists(partial)


def test_stale_partial_dir_is_replaced_without_resume(sources, tmp_path):
    src, _ = sources["qwen"]
    dst = str(tmp_path / "out")
    partial = partial_dir_for(dst)
    os.makedirs(partial)
    with pytest.raises(ValueError, match="not written by"):
        convert_checkpoint(src, dst, arch="sm90", **QUIET)
    with open(os.path.join(partial, ".megamoe-convert-state.json"), "w") as f:
        json.dump({"fingerprint": "old", "done": {}}, f)
    convert_checkpoint(src, dst, arch="sm90", **QUIET)
    assert verify_checkpoint(dst, **QUIET) == []


# -- bad input: clear error, no output --------------------------------------------------------

def _broken_source(tmp_path, convention, edit):
    tensors = build_tensors(convention, layers=2)
    edit(tensors)
    src = str(tmp_path / "src")
    write_checkpoint(src, tensors, config_for(convention, 2, 4, 256, 128), shards=2)
    return src


@pytest.mark.parametrize("convention,edit,message", [
    ("qwen", lambda t: t.pop("model.layers.1.mlp.experts.2.up_proj.weight"),
     "model.layers.1.mlp.experts.2.up_proj.weight is missing"),
    ("mixtral", lambda t: t.update({"model.layers.0.block_sparse_moe.experts.1.w2.weight":
                                    torch.zeros(256, 256, dtype=torch.bfloat16)}),
     "'model.layers.0.block_sparse_moe.experts.1.w2.weight' has shape [256, 256], expected [256, 128]"),
    ("qwen", lambda t: t.update({"model.layers.0.mlp.experts.0.gate_proj.weight":
                                 torch.zeros(128, 256, dtype=torch.int32)}),
     "'model.layers.0.mlp.experts.0.gate_proj.weight' has dtype I32"),
    ("qwen", lambda t: t.update({"model.layers.0.mlp.experts.3.down_proj.weight":
                                 torch.zeros(256, 128, dtype=torch.float16)}),
     "'model.layers.0.mlp.experts.3.down_proj.weight' has dtype F16"),
    ("deepseek-fp8", lambda t: t.pop("model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"),
     "model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv is missing"),
    ("stacked-linear", lambda t: t.pop("model.layers.1.feed_forward.experts.down_proj"),
     "model.layers.1.feed_forward.experts.down_proj is missing"),
    ("stacked-linear", lambda t: t.update({"model.layers.0.feed_forward.experts.gate_up_proj_bias":
                                           torch.zeros(4, 256)}),
     "no biases"),
    ("stacked-transposed", lambda t: t.update({"model.layers.0.feed_forward.experts.down_proj":
                                               torch.zeros(4, 100, 256, dtype=torch.bfloat16)}),
     "fit neither"),
])
def test_bad_input_gives_clear_error_and_no_output(tmp_path, capsys, convention, edit, message):
    src = _broken_source(tmp_path, convention, edit)
    dst = str(tmp_path / "out")
    with pytest.raises(ValueError) as info:
        convert_checkpoint(src, dst, arch="sm90", **QUIET)
    assert message in str(info.value)
    assert cli_main(["convert", src, dst, "--arch", "sm100", "--no-progress"]) == 2
    assert message in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_unknown_safetensors_dtype_is_named(tmp_path):
    src = str(tmp_path / "src")
    make_checkpoint(src, "qwen", layers=2, shards=1)
    path = os.path.join(src, "model.safetensors")
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["model.layers.0.mlp.experts.0.up_proj.weight"]["dtype"] = "Q4_K"
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    with open(path, "wb") as f:
        f.write(data[:8] + text + data[8 + n:])
    with pytest.raises(ValueError, match="'model.layers.0.mlp.experts.0.up_proj.weight' in "
                       "model.safetensors has unknown dtype 'Q4_K'"):
        convert_checkpoint(src, str(tmp_path / "out"), arch="sm90", **QUIET)
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_bad_options(sources, tmp_path):
    src, _ = sources["qwen"]
    with pytest.raises(ValueError, match="does not run on sm90"):
        convert_checkpoint(src, str(tmp_path / "o"), arch="sm90", fmt="mxfp4", **QUIET)
    with pytest.raises(ValueError, match="not found"):
        convert_checkpoint(str(tmp_path / "nope"), str(tmp_path / "o"), arch="sm90", **QUIET)
    with pytest.raises(ValueError, match="overlaps SRC"):
        convert_checkpoint(src, os.path.join(src, "sub"), arch="sm90", **QUIET)
    assert os.listdir(tmp_path) == []


# -- data safety: --overwrite, default format, corrupt checkpoints (issue 53) -----------------

def test_overwrite_refuses_a_directory_that_is_not_a_checkpoint(sources, tmp_path, capsys):
    """--overwrite replaces only a checkpoint (or a converter's partial output): someone's
    directory is refused with a message and left exactly as it was."""
    src, _ = sources["mixtral"]
    dst = tmp_path / "notes"
    dst.mkdir()
    (dst / "notes.txt").write_text("my notes\n")
    (dst / "sub").mkdir()
    (dst / "sub" / "data.bin").write_bytes(b"x" * 10)
    before = file_digests(str(dst))
    assert cli_main(["convert", src, str(dst), "--arch", "sm90", "--overwrite", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: DST {dst} is not a checkpoint that --overwrite may replace: it holds notes.txt, sub, "
                   "not a checkpoint (config.json with *.safetensors weights). --overwrite replaces only an "
                   "earlier conversion or another model checkpoint; nothing was changed. Remove it yourself or "
                   "choose another DST\n")
    assert file_digests(str(dst)) == before and sorted(os.listdir(tmp_path)) == ["notes"]
    with pytest.raises(ValueError, match="is not a checkpoint that --overwrite may replace"):
        convert_checkpoint(src, str(dst), arch="sm90", overwrite=True, **QUIET)
    assert file_digests(str(dst)) == before
    # a config.json alone is no checkpoint either; a file is no directory
    (dst / "config.json").write_text("{}")
    assert cli_main(["convert", src, str(dst), "--arch", "sm90", "--overwrite", "--no-progress"]) == 2
    assert "it holds config.json, notes.txt, sub" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert cli_main(["convert", src, str(tmp_path / "file"), "--arch", "sm90", "--overwrite"]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "x"
    # what --overwrite does replace: an earlier conversion (also a corrupt one), a HF checkpoint, nothing
    out = str(tmp_path / "out")
    convert_checkpoint(src, out, arch="sm90", fmt="bf16", **QUIET)
    os.remove(os.path.join(out, sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))[0]))
    convert_checkpoint(src, out, arch="sm90", fmt="fp8-block", overwrite=True, **QUIET)
    assert verify_checkpoint(out, **QUIET) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    convert_checkpoint(src, str(empty), arch="sm90", overwrite=True, **QUIET)
    assert verify_checkpoint(str(empty), **QUIET) == []


def test_default_format_keeps_the_source_precision(sources, tmp_path, capsys):
    """Without --format, BF16 experts stay BF16 and FP8-block experts stay FP8-block; quantizing
    takes an explicit --format, and the command lists every tensor it quantized."""
    bf16_src, _ = sources["qwen"]
    out = str(tmp_path / "bf16")
    assert cli_main(["convert", bf16_src, out, "--arch", "sm90", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "expert precision kept: bf16 experts stored as bf16, no tensor quantized" in captured.out
    assert read_megamoe_marker(json.load(open(os.path.join(out, "config.json"))))["format"] == "bf16"
    assert load_all(out)["model.layers.1.mlp.experts.w13_weight"].dtype == torch.bfloat16
    fp8_src, _ = sources["deepseek-fp8"]
    out = str(tmp_path / "fp8")
    assert cli_main(["convert", fp8_src, out, "--arch", "sm90", "--no-progress"]) == 0
    assert "no tensor quantized" in capsys.readouterr().out
    assert read_megamoe_marker(json.load(open(os.path.join(out, "config.json"))))["format"] == "fp8-block"
    # sm100 does not run FP8-block experts: the format must be chosen, nothing is written
    out = str(tmp_path / "fp8-sm100")
    assert cli_main(["convert", fp8_src, out, "--arch", "sm100", "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        "error: the source's experts are FP8 128x128-block, which sm100 does not run as they are: pick the "
        "format explicitly: --format mxfp4 (dequantized, then quantized to MXFP4 (E2M1 with UE8M0 scales per 32 "
        "values)); --format bf16 (dequantized from FP8 to BF16)\n")
    assert not os.path.exists(out)
    # quantizing is explicit and listed
    out = str(tmp_path / "q")
    assert cli_main(["convert", bf16_src, out, "--arch", "sm90", "--format", "fp8-block", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert ("sm90 fp8-block: the experts of 3 MoE layer(s) are quantized to FP8 e4m3 with 128x128 block scales "
            "(the source's are bf16); 6 tensors, listed when done") in captured.err
    assert captured.out.splitlines()[-1] == (
        "6 expert tensors quantized to FP8 e4m3 with 128x128 block scales (the source's are bf16): "
        + ", ".join(f"model.layers.{n}.mlp.experts.{t}" for n in range(3) for t in ("w13_weight", "w2_weight")))
    result = convert_checkpoint(bf16_src, str(tmp_path / "api"), arch="sm100", fmt="mxfp4", **QUIET)
    assert result.precision_change.startswith("quantized to MXFP4") and len(result.changed_tensors) == 6


def test_inspect_of_a_corrupt_checkpoint_is_an_error(tmp_path, capsys):
    """A truncated shard, or an index naming a missing shard, is a non-zero exit, not a summary."""
    src = str(tmp_path / "src")
    make_checkpoint(src, "qwen", layers=2, shards=2)
    assert cli_main(["inspect", src]) == 0
    capsys.readouterr()
    shard = os.path.join(src, sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))[-1])
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 1000)
    assert cli_main(["inspect", src]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {src} is corrupt or incomplete: tensor ")
    assert captured.err.endswith(f"the file size {size - 1000}; the file is truncated or corrupt\n")
    os.remove(shard)
    assert cli_main(["inspect", src]) == 1
    assert "which is missing from" in capsys.readouterr().err
    # a converted checkpoint whose shard lost its expert tensors: also an error
    src2 = str(tmp_path / "src2")
    make_checkpoint(src2, "qwen", layers=2, shards=1)
    dst = str(tmp_path / "dst")
    convert_checkpoint(src2, dst, arch="sm90", **QUIET)
    index_path = os.path.join(dst, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    config = json.load(open(os.path.join(dst, "config.json")))
    config["megamoe"]["expert_modules"].append("model.layers.9.mlp.experts")
    _write_json(os.path.join(dst, "config.json"), config)
    assert cli_main(["inspect", dst]) == 1
    assert ("is corrupt or incomplete: model.layers.9.mlp.experts: w13_weight/w2_weight missing"
            in capsys.readouterr().err)
    assert index["megamoe"]["sha256"]


# -- marker helpers and sizes ----------------------------------------------------------------

def test_marker_helpers():
    assert read_megamoe_marker({"model_type": "mixtral"}) is None
    marker = {"format": "fp8-block", "arch": "sm90", "layout_version": 1}
    assert read_megamoe_marker({"megamoe": marker}) == marker
    check_marker_matches(marker, "sm90", "fp8-block")
    check_marker_matches(marker, "sm90")
    with pytest.raises(ValueError, match="converted by `vllm-megamoe convert` for sm90 fp8-block, "
                       "but this GPU needs sm100.*--arch sm100"):
        check_marker_matches(marker, "sm100")
    with pytest.raises(ValueError, match="--format bf16"):
        check_marker_matches(marker, "sm90", "bf16")
    with pytest.raises(ValueError, match="layout_version=2"):
        read_megamoe_marker({"megamoe": dict(marker, layout_version=2)})
    with pytest.raises(ValueError, match="lacks"):
        read_megamoe_marker({"megamoe": {"format": "bf16"}})


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1234") == 1234
    assert parse_size("1.5G") == 1_500_000_000
    with pytest.raises(ValueError, match="not understood"):
        parse_size("lots")


def test_inspect_json_fields(sources, tmp_path):
    src, dst, _ = _converted(sources, tmp_path, "deepseek-fp8", "sm100", "mxfp4")
    info = inspect_checkpoint(dst)
    assert info["megamoe"]["format"] == "mxfp4" and info["checksummed_files"] == info["weight_files"]
    assert [(l["experts"], l["hidden"], l["intermediate"]) for l in info["layers"]] == [(4, 256, 128)] * 2
    assert "utccp" in format_inspection(info)
    src_info = inspect_checkpoint(src)
    assert src_info["megamoe"] is None and src_info["layers"][0]["dtype"] == "F8_E4M3"


# -- malformed files and options: clear errors, never a traceback -----------------------------

def _write_json(path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def test_config_json_not_an_object(tmp_path, capsys):
    src = str(tmp_path / "src")
    make_checkpoint(src, "qwen", layers=2, shards=1)
    _write_json(os.path.join(src, "config.json"), [1, 2])
    message = "config.json must hold a JSON object"
    with pytest.raises(ValueError, match=message):
        convert_checkpoint(src, str(tmp_path / "out"), arch="sm90", **QUIET)
    assert cli_main(["convert", src, str(tmp_path / "out"), "--arch", "sm90"]) == 2
    assert message in capsys.readouterr().err
    assert cli_main(["inspect", src]) == 2
    assert message in capsys.readouterr().err
    assert message in verify_checkpoint(src, **QUIET)[0]
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_source_quantization_config_and_index_must_be_objects(tmp_path, capsys):
    src = str(tmp_path / "src")
    make_checkpoint(src, "qwen", layers=2, shards=2)
    config_path = os.path.join(src, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    _write_json(config_path, dict(config, quantization_config=[1]))
    with pytest.raises(ValueError, match="'quantization_config' must be a JSON object, got a JSON array"):
        convert_checkpoint(src, str(tmp_path / "out"), arch="sm90", **QUIET)
    assert cli_main(["inspect", src]) == 2
    assert "'quantization_config' must be a JSON object" in capsys.readouterr().err
    _write_json(config_path, config)
    _write_json(os.path.join(src, "model.safetensors.index.json"), {"weight_map": [1]})
    with pytest.raises(ValueError, match="has no 'weight_map'; is it a safetensors index"):
        convert_checkpoint(src, str(tmp_path / "out"), arch="sm90", **QUIET)


def test_verify_reports_a_malformed_index(sources, tmp_path, capsys):
    _, dst, index = _converted(sources, tmp_path)
    index_path = os.path.join(dst, "model.safetensors.index.json")
    for bad, what in [({"weight_map": 5}, "'weight_map'"), ([1], "JSON object"),
                      (dict(index, megamoe=[1]), "'megamoe'"),
                      (dict(index, megamoe={"sha256": {"x.safetensors": 7}}), "'sha256'")]:
        _write_json(index_path, bad)
        problems = verify_checkpoint(dst, **QUIET)
        assert len(problems) == 1 and "model.safetensors.index.json" in problems[0], problems
        assert what in problems[0]
        assert cli_main(["verify", dst]) == 1
        assert what in capsys.readouterr().err


def test_uncreatable_dst_exits_2(tmp_path, capsys, monkeypatch):
    src = str(tmp_path / "src")
    make_checkpoint(src, "mixtral", layers=2, shards=1)
    open(tmp_path / "file", "w").close()
    dst = str(tmp_path / "file" / "out")
    with pytest.raises(ValueError, match="cannot create DST"):
        convert_checkpoint(src, dst, arch="sm90", **QUIET)
    assert cli_main(["convert", src, dst, "--arch", "sm90", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot create DST {dst}: ") and err.count("\n") == 1
    assert str(tmp_path / "file") in err
    # an OSError later on (here: writing a shard) is one line and exit 2 too

    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(writer, "to_kernel_layout", failing)
    assert cli_main(["convert", src, str(tmp_path / "out"), "--arch", "sm90"]) == 2
    assert capsys.readouterr().err == "error: [Errno 28] No space left on device (injected)\n"
    assert sorted(os.listdir(tmp_path)) == ["file", "src"]


def test_marker_field_types(sources, tmp_path, capsys):
    marker = {"format": "bf16", "arch": "sm90", "layout_version": 1}
    for key, value in [("expert_modules", "model.layers.0.mlp.experts"),
                       ("expert_modules", [1, 2]), ("arch", ["sm90"]), ("format", None),
                       ("layout_version", "1")]:
        with pytest.raises(ValueError, match=f"'megamoe' field {key!r} must be"):
            read_megamoe_marker({"megamoe": dict(marker, **{key: value})})
    _, dst, _ = _converted(sources, tmp_path)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["megamoe"]["expert_modules"] = "model.layers.1.mlp.experts"
    _write_json(os.path.join(dst, "config.json"), config)
    problems = verify_checkpoint(dst, **QUIET)
    assert len(problems) == 1 and "'expert_modules' must be a list" in problems[0]
    assert cli_main(["verify", dst]) == 1
    assert "expert_modules" in capsys.readouterr().err


@pytest.mark.parametrize("argv,option", [
    (["verify", "d", "--samples", "-1"], "--samples"),
    (["convert", "s", "d", "--arch", "sm90", "--workers", "0"], "--workers"),
    (["convert", "s", "d", "--arch", "sm90", "--workers", "-3"], "--workers"),
    (["convert", "s", "d", "--arch", "sm90", "--max-shard-size", "0.0001"], "--max-shard-size"),
    (["convert", "s", "d", "--arch", "sm90", "--max-shard-size", "lots"], "--max-shard-size"),
])
def test_cli_refuses_bad_counts_and_sizes(argv, option, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: " in err and argv[-1] in err


def test_python_api_refuses_bad_counts_and_sizes(sources, tmp_path):
    src, _ = sources["qwen"]
    dst = str(tmp_path / "out")
    with pytest.raises(ValueError, match="max_shard_bytes must be at least 1 byte, got -5"):
        convert_checkpoint(src, dst, arch="sm90", max_shard_bytes=-5, **QUIET)
    for workers in (0, -3):
        with pytest.raises(ValueError, match=f"workers must be at least 1, got {workers}"):
            convert_checkpoint(src, dst, arch="sm90", workers=workers, **QUIET)
    with pytest.raises(ValueError, match="size '0.0001' is 0 bytes"):
        parse_size("0.0001")
    with pytest.raises(ValueError, match="size -5 is -5 bytes; give at least 1 byte"):
        parse_size(-5)
    with pytest.raises(ValueError, match="samples must be at least 0, got -1"):
        verify_checkpoint(src, samples=-1, **QUIET)
    assert os.listdir(tmp_path) == []


def test_to_kernel_layout_checks_sm90_inputs():
    from vllm_megamoe.convert import to_kernel_layout
    w13 = (torch.randn(2, 256, 256) * 0.05).to(quant.FP8_DTYPE)
    w2 = (torch.randn(2, 256, 128) * 0.05).to(quant.FP8_DTYPE)
    s2 = torch.ones(2, 2, 1)
    for fmt in ("fp8-block", "bf16"):
        with pytest.raises(ValueError, match="w13_scale_inv and w2_scale_inv"):
            to_kernel_layout(w13, w2, arch="sm90", fmt=fmt)
        with pytest.raises(ValueError, match="; w13_scale_inv not given"):
            to_kernel_layout(w13, w2, arch="sm90", fmt=fmt, w2_scale_inv=s2)
    for h, i, name in ((200, 128, "hidden=200"), (256, 100, "intermediate=100")):
        w13 = torch.zeros(2, 2 * i, h, dtype=torch.bfloat16)
        w2 = torch.zeros(2, h, i, dtype=torch.bfloat16)
        for arch in ("sm90", "sm100"):
            with pytest.raises(ValueError, match=f"{name}.*multiple.* of 128"):
                to_kernel_layout(w13, w2, arch=arch, fmt="bf16")
