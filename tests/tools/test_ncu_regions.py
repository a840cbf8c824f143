"""benchmarks.ncu_regions: stall samples joined with nvdisasm -gi's inline chains."""
import textwrap

from benchmarks import ncu_regions

DISASSEMBLY = textwrap.dedent("""\
        .text.k:
        //## File "/src/k.cu", line 10
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        //## File "/src/inner.cuh", line 5 inlined at "/src/mid.cuh", line 7
        //## File "/src/mid.cuh", line 7 inlined at "/src/k.cu", line 12
        //## File "/src/k.cu", line 12
        /*0010*/                   FFMA R2, R3, R4, R2 ;
        /*0020*/              @!P0 BRA 0x40 ;
        //## File "/src/k.cu", line 14
        /*0030*/                   EXIT ;
""")

REPORT = textwrap.dedent("""\
    "Kernel Name","k",
    "Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"
    "0x7f0000001000","MOV R1, c[0x0][0x28]","10","1"
    "0x7f0000001010","FFMA R2, R3, R4, R2","60","100"
    "0x7f0000001020","@!P0 BRA 0x7f0000001040","20","100"
    "0x7f0000001030","EXIT","10","1"
""")


def test_samples_go_to_the_innermost_line_its_caller_and_the_kernel_line(tmp_path):
    csv_path = tmp_path / "source.csv"
    csv_path.write_text(REPORT)
    chains = ncu_regions.line_chains(DISASSEMBLY)
    assert chains[0x10][0] == [("inner.cuh", 5), ("mid.cuh", 7), ("k.cu", 12)]
    assert chains[0x20][0] == chains[0x10][0]  # no new line-table entry: the same chain
    assert chains[0x20][1] == "BRA"  # the predicate is not the opcode
    result = ncu_regions.attribute(ncu_regions.read_report(str(csv_path)), chains)
    assert result["total"] == 100 and result["mismatches"] == 0
    assert result["inner"]["inner.cuh:5"] == 80 and result["inner"]["k.cu:10"] == 10
    assert result["pair"][("inner.cuh:5", "mid.cuh:7")] == 80
    assert result["outer"]["k.cu:12"] == 80 and result["outer"]["k.cu:14"] == 10


def test_a_different_cubin_is_reported(tmp_path):
    csv_path = tmp_path / "source.csv"
    csv_path.write_text(REPORT.replace("FFMA R2", "IMAD R2"))
    result = ncu_regions.attribute(ncu_regions.read_report(str(csv_path)), ncu_regions.line_chains(DISASSEMBLY))
    assert result["mismatches"] == 1
