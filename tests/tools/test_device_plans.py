"""The kernel probes scripts/device_tune.sh runs on a device, checked here without one: every build
each probe's default arguments load (every shape, variant and EP size) must be one the host accepts
(its shared memory fits, its knobs are valid). A probe whose build does not fit fails at its first
call, after the device time to reach it is spent (it happened with `stages=5` beside 128-token builds)."""
import pathlib
import re

import pytest

from benchmarks import kernel_probe as kp
from vllm_megamoe.kernels import sm90_mega_moe

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "device_tune.sh"
DEFAULT_SHAPES = ["v4-flash", "deepseek-v3", "qwen3-30b-a3b"]  # kernel_probe's --shapes default


def _default(word: str) -> str:
    """`${NAME:-a b}` -> `a b`; a literal stays."""
    m = re.fullmatch(r"\$\{\w+:-(.*)\}", word)
    return m.group(1) if m else word


def _flag(command: str, flag: str):
    """The words after `flag` up to the next flag, with ${X:-default} expanded to its default."""
    m = re.search(rf"{flag} ((?:\$\{{\w+:-[^}}]*\}}|[^-\s][^\s]*)(?: (?:\$\{{\w+:-[^}}]*\}}|[^-\s][^\s]*))*)", command)
    if not m:
        return None
    words = []
    for word in re.findall(r"\$\{\w+:-[^}]*\}|\S+", m.group(1)):
        words += _default(word).split()
    return words


def probe_commands() -> list[str]:
    text = SCRIPT.read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if line.lstrip().startswith("#") or "benchmarks.kernel_probe" not in line:
            continue
        commands.append(re.split(r"2>&1|>", line.split("benchmarks.kernel_probe", 1)[1])[0])
    return commands


def _shapes(command: str) -> list[str]:
    """The shapes a probe runs; a loop's variable alone ($1, $shape) stands for every default shape."""
    given = _flag(command, "--shapes") or DEFAULT_SHAPES
    return [s for s in given if "$" not in s] or (DEFAULT_SHAPES if all("$" in s for s in given) else [])


def probe_builds():
    cases = []
    for command in probe_commands():
        gpus = _flag(command, "--gpus") or ["2"]
        worlds = {1, 2, int(gpus[0])} if "GPUS" in command else {int(gpus[0])}  # GPUS=1 or 2
        shapes = _shapes(command)
        fmt = (_flag(command, "--format") or ["fp8-block"])[0]
        fmts = ["fp8-block", "bf16"] if "$" in fmt else [fmt]  # a loop's variable ($fmt): both formats
        # a count set only at run time ($tokens) is checked at 8192, the largest any plan runs
        tokens = max([int(t) for t in (_flag(command, "--tokens") or ["8192"]) if t.isdigit()] or [8192])
        # a variant set only at run time ($ab, "$v", $PROBE_VARIANTS) is checked as the default build
        variants = [v for v in (_flag(command, "--variants") or ["default"]) if "$" not in v] or ["default"]
        for world in sorted(worlds):
            for shape in shapes:
                for variant in variants:
                    cases += [(world, shape, f, tokens, variant) for f in fmts]
    return cases


def test_the_script_has_probes():
    cases = probe_builds()
    assert len(probe_commands()) >= 2 and len(cases) >= 20
    for command in probe_commands():  # each gives cases: none is skipped unread
        assert _shapes(command), command
    assert (1, "v4-flash", "fp8-block", 8192, "stages=5,tile=32") in cases


@pytest.mark.parametrize("world, shape, fmt, tokens, variant", probe_builds())
def test_every_probe_build_is_accepted(world, shape, fmt, tokens, variant, monkeypatch):
    for name in kp.KNOBS.values():
        monkeypatch.delenv(name, raising=False)
    with kp.scoped_env(kp.variant_env(variant)):
        specs = sm90_mega_moe.layer_kernel_specs([kp.probe_shape(shape)], fmt, world, tokens)
    assert specs


def test_a_build_that_does_not_fit_is_caught(monkeypatch):
    """What the check above guards against: 5 stages forced beside a 128-token build."""
    with kp.scoped_env(kp.variant_env("stages=5")):
        with pytest.raises(ValueError, match="5 stages need"):
            sm90_mega_moe.layer_kernel_specs([kp.probe_shape("qwen3-30b-a3b")], "fp8-block", 2, 8)


def test_every_device_script_parses():
    import subprocess
    for script in sorted(SCRIPT.parent.glob("device_*.sh")) + [SCRIPT.parent / "precompile_for_device.sh"]:
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, f"{script.name}: {done.stderr}"
