"""benchmarks.sass_census: loops, instruction classes and SASS comparison from nvdisasm text."""
import textwrap

import pytest

from benchmarks import sass_census

# A K loop (label .L_x_2 .. its backward branch) holding a stage-wait retry loop (.L_x_3), inside
# a task loop (.L_x_1); a forward branch that is no loop.
SASS = textwrap.dedent("""\
        /*0000*/                   S2R R8, SR_TID.X ;
.L_x_1:
        /*0010*/                   IMAD R2, R8, 0x4, RZ ;
.L_x_2:
        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R61+URZ+0x2a800], R56 ;
.L_x_3:
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R61+URZ+0x2a800], R56 ;
        /*0040*/              @!P1 BRA `(.L_x_3) ;
        /*0050*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT ;
        /*0060*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24, gsb0 ;
        /*0070*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0080*/                   FFMA R196, R27, R202, R196 ;
        /*0090*/                   FFMA R197, R28, R203, R197 ;
        /*00a0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00b0*/               @P0 BRA `(.L_x_4) ;
        /*00c0*/              @!P2 BRA `(.L_x_2) ;
.L_x_4:
        /*00d0*/                   STG.E [R2.64], R196 ;
        /*00e0*/              @!P3 BRA `(.L_x_1) ;
        /*00f0*/                   EXIT ;
""")


def test_parse_keeps_order_predicates_and_labels():
    ins = sass_census.parse(SASS)
    assert len(ins) == 16
    assert ins[0].base == "S2R" and ins[1].label == ".L_x_1" and ins[2].label == ".L_x_2"
    assert ins[4].text == "@!P1 BRA `(.L_x_3)" and ins[4].base == "BRA"
    assert ins[5].opcode == "QGMMA.64x64x32.F32.E4M3.E4M3" and ins[5].base == "QGMMA"


def test_loops_are_backward_branches_and_wgmma_loops_hold_a_wgmma():
    ins = sass_census.parse(SASS)
    found = {lp.label: (lp.start, lp.end) for lp in sass_census.loops(ins)}
    assert found == {".L_x_1": (1, 14), ".L_x_2": (2, 12), ".L_x_3": (3, 4)}  # .L_x_4 is a forward branch
    assert [lp.label for lp in sass_census.wgmma_loops(ins)] == [".L_x_1", ".L_x_2"]
    k_loop = sass_census.wgmma_loops(ins)[1]
    counts = sass_census.census(k_loop.body(ins))
    assert counts["QGMMA"] == 2 and counts["FFMA"] == 2 and counts["SYNCS"] == 2 and counts["BRA"] == 3
    report = "\n".join(sass_census.describe("toy", ins, "ptxas info: Used 238 registers, 0 bytes spill stores", 5))
    assert "238 registers, 0 bytes spilled" in report
    assert "holds 1 wgmma loops at .L_x_1" in report and "K loop at .L_x_2" in report
    assert "local memory: 0 STL, 0 LDL (in K loops: 0 STL, 0 LDL)" in report
    spilled = sass_census.parse(SASS.replace("IMAD R2, R8, 0x4, RZ", "STL [R1], R8").replace(
        "FFMA R197, R28, R203, R197", "LDL R197, [R1]").replace("STG.E [R2.64], R196", "LDL R8, [R1]"))
    assert sass_census.local_memory(spilled, sass_census.wgmma_loops(spilled)) == \
        "local memory: 1 STL, 2 LDL (in K loops: 0 STL, 1 LDL)"


def test_summary_cell_gives_registers_spills_and_k_loop_lengths():
    spilled = sass_census.parse(SASS.replace("IMAD R2, R8, 0x4, RZ", "STL [R1], R8").replace(
        "STG.E [R2.64], R196", "LDL R8, [R1]"))
    log = "ptxas info: Used 168 registers, 4 bytes spill stores, 4 bytes spill loads"
    assert sass_census.summary(spilled, log) == "168, 4 B, 1 / 1; 11"  # the K loop .L_x_2: instructions 2-12
    assert sass_census.summary(sass_census.parse(SASS), "") == "?, ? B, 0 / 0; 11"


def test_same_sass_ignores_addresses_and_label_numbers_but_not_registers():
    renumbered = SASS.replace(".L_x_", ".L_x_9").replace("/*00", "/*01")
    ins, other = sass_census.parse(SASS), sass_census.parse(renumbered)
    assert sass_census.same_sass(ins, other) == (True, -1)
    changed = sass_census.parse(SASS.replace("FFMA R197, R28", "FFMA R197, R29"))
    assert sass_census.same_sass(ins, changed) == (False, 9)
    assert sass_census.same_sass(ins, ins[:-1]) == (False, 15)


def test_build_specs_are_checked():
    assert sass_census.parse_build("v4-flash:fp8-block:64") == ("v4-flash", "fp8-block", 64)
    for bad in ("v4-flash:fp8-block", "4096x2048x256x6:bf16:128:wgmma"):  # the mainloop field is gone
        with pytest.raises(SystemExit, match="SHAPE:FORMAT:TILE"):
            sass_census.parse_build(bad)


def _have_tools():
    try:
        sass_census.find_nvdisasm()
        from vllm_megamoe.kernels import jit
        return jit.nvrtc_available()
    except (SystemExit, ImportError):
        return False


@pytest.mark.skipif(not _have_tools(), reason="needs nvdisasm and NVRTC")
def test_the_fp8_k_loop_issues_two_groups_of_four_wgmmas_per_chunk():
    cubin, log = sass_census.compile_build("v4-flash:fp8-block:64")
    ins = sass_census.parse(sass_census.disassemble(cubin))
    found = sass_census.wgmma_loops(ins)
    k_loops = [lp for lp in found if not any(o is not lp and lp.start <= o.start and o.end <= lp.end for o in found)]
    per_loop = {sass_census.census(lp.body(ins))["QGMMA"] for lp in k_loops}
    assert per_loop == {8}, per_loop  # 2 groups x 4 k-steps of 32 bytes, in every K loop (L1, L2, full, narrow)
    # one wait per group, none between a group's k-steps (a silently serialised loop waits after each)
    waits = {sum("DEPBAR" in i.opcode for i in lp.body(ins)) for lp in k_loops}
    assert waits == {2}, waits
    # the full tasks' loops take the tokens from registers (ldmatrix), the narrow ones from shared memory
    register_a = [any(i.base == "LDSM" for i in lp.body(ins)) for lp in k_loops]
    assert any(register_a) and not all(register_a), register_a


@pytest.mark.skipif(not _have_tools(), reason="needs nvdisasm and NVRTC")
@pytest.mark.parametrize("build", ["v4-flash:fp8-block:64", "qwen3-30b-a3b:fp8-block:64"])
def test_register_token_loops_reload_only_with_nothing_in_flight(build):
    """The register-token K loops write their fragment registers (the ldmatrix destinations that
    both groups' wgmmas read) only between the loop's wait for all groups and its first wgmma: a
    group starting while the fragment is reloaded comes out wrong (tests/gpu/test_wgmma_rs.py)."""
    import re
    cubin, _ = sass_census.compile_build(build)
    ins = sass_census.parse(sass_census.disassemble(cubin))
    loops = [lp for lp in sass_census.wgmma_loops(ins) if any(i.base == "LDSM" for i in lp.body(ins))
             and sass_census.census(lp.body(ins))["QGMMA"] == 8]
    assert len(loops) >= 2  # L1 and L2 (inlined at each call site)
    for lp in loops:
        body = lp.body(ins)
        frag = {int(re.match(r"LDSM\S*\s+R(\d+)", i.text).group(1)) + j for i in body if i.base == "LDSM" for j in range(4)}
        qgmma = [k for k, i in enumerate(body) if i.base == "QGMMA"]
        reads = {int(re.match(r"QGMMA\S*\s+R\d+,\s*R(\d+),", body[k].text).group(1)) + j for k in qgmma for j in range(4)}
        assert len(frag) == 16 and reads == frag
        waits_all = [k for k, i in enumerate(body) if i.text.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0")]
        assert waits_all, f"{lp.label}: no wait for all groups before the reload"
        wait_all = waits_all[0]
        for k, i in enumerate(body):
            m = re.match(r"(?:@!?U?P\w+\s+)?[A-Z][\w.]*\s+R(\d+)\b", i.text)
            if m and i.base not in ("QGMMA", "STS", "STG", "ST", "STL", "BRA") and int(m.group(1)) in frag:
                assert wait_all < k < qgmma[0], f"{lp.label}: {i.text} writes the fragment while a group may run"
